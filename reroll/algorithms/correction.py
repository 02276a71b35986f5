"""Off-policy correction for the train/inference mismatch: truncated or masked importance sampling.

The rollout engine (vLLM, SGLang) samples from pi_rollout, which differs from the trainer's
pi_old even with the same weights (kernels, precision). Its log-probs come with the rollout;
the weight w = pi_old / pi_rollout multiplies the policy-gradient term of each token (or of
each sequence) so that the gradient is taken under the right distribution.

References: Yao et al., "Your efficient RL framework secretly brings you off-policy RL
training" (2025, truncated IS, TIS); Liu, Li et al., "When speed kills stability" (2025,
token/sequence-level IS and rejection, verl's rollout correction); IcePop (Ling team, 2025,
masking tokens whose ratio leaves a band).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from reroll.algorithms.aggregation import masked_mean

ISLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]


def rollout_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    *,
    level: ISLevel = "token",
    mode: ISMode = "truncate",
    max_weight: float = 2.0,
    min_weight: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """w = pi_old / pi_rollout, then min(w, max) (TIS) or w * 1[min <= w <= max] (masked IS): (B, T) -> (B, T).

    ``level="token"``: w_t = exp(log pi_old_t - log pi_rollout_t). ``level="sequence"``: one
    weight per sequence, w_i = exp(sum_t (log pi_old_t - log pi_rollout_t)), on all its tokens.
    Weights are detached and zero outside the mask. A masked token keeps its place in the
    loss's denominator (its weight is 0), so micro-batched and full-batch losses still agree.
    Metrics: ``correction/is_mean``, ``correction/clipped_frac`` (tokens truncated or
    masked), ``correction/mismatch_kl`` (k1 estimate of KL(pi_rollout || pi_old)).
    """
    with torch.no_grad():
        log_w = torch.where(response_mask, old_logprobs - rollout_logprobs, 0.0)
        if level == "sequence":
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
        raw = torch.exp(log_w.clamp(min=-20.0, max=20.0))
        if mode == "truncate":
            weights = raw.clamp(max=max_weight)
            changed = raw > max_weight
        else:
            inside = (raw >= min_weight) & (raw <= max_weight)
            weights = torch.where(inside, raw, 0.0)
            changed = ~inside
        weights = torch.where(response_mask, weights, 0.0)
        gap = torch.where(response_mask, rollout_logprobs - old_logprobs, 0.0)
        metrics = {
            "correction/is_mean": masked_mean(raw, response_mask),
            "correction/clipped_frac": masked_mean(changed.float(), response_mask),
            "correction/mismatch_kl": masked_mean(gap, response_mask),
        }
    return weights, metrics


def mismatch_metrics(trainer: Tensor, engine: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's on the same tokens (``mismatch/*``);
    none where ``mask`` marks no token."""
    scored = mask.reshape(-1).nonzero().squeeze(-1)
    if not scored.numel():
        return {}
    return {k: float(v) for k, v in scored_mismatch(trainer, engine, scored.to(trainer.device)).items()}


def scored_mismatch(trainer: Tensor, engine: Tensor, scored: Tensor) -> dict[str, Tensor]:
    """``mismatch_metrics`` as scalar tensors on the log-probs' device, at the tokens ``scored`` (flat
    indices into ``(B, T)``, at least one, in row-major order: ``x[mask]``'s elements, so the means are
    the same sums in the same order). Its output's size is known from ``scored``'s, so the host does not
    wait for the GPU (selecting by a mask on the GPU does)."""
    diff = (trainer.detach().float() - engine.float()).reshape(-1)[scored]
    # k3 estimate of KL(engine || trainer) from tokens the engine sampled: r - 1 - log r with
    # r = p_trainer / p_engine (Schulman's estimator with the sampling distribution in the denominator).
    # The other way round, e^(engine - trainer) explodes on a token the trainer now finds unlikely.
    kl = (diff.exp() - 1 - diff).mean()
    return {
        "mismatch/logprob_abs_mean": diff.abs().mean(),
        "mismatch/logprob_abs_max": diff.abs().max(),
        "mismatch/kl": kl,
    }
