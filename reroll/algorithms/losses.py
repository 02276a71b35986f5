"""Policy losses, per token: each returns ``(loss (B, T), metrics)`` and leaves aggregation to ``aggregate``.

Common arguments: ``logprobs`` (B, T) log pi_theta of the sampled tokens (with gradient),
``old_logprobs`` (B, T) log pi_old of the policy that the advantages were computed for (no
gradient), ``advantages`` (B, T), ``response_mask`` bool (B, T). The ratio is
r_t = exp(log pi_theta - log pi_old), with the log-ratio clamped to +-20 against overflow.

Metrics are detached scalar tensors, means over this micro-batch's masked tokens:
``actor/ratio_mean``, ``actor/approx_kl`` (mean of log pi_old - log pi_theta, k1 of the
update) and ``actor/clipfrac`` (fraction of tokens whose gradient the clip removed or
reweighted).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from reroll.algorithms.aggregation import masked_mean

Metrics = dict[str, Tensor]


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return (logprobs - old_logprobs).clamp(min=-20.0, max=20.0)


def _ratio_metrics(log_ratio: Tensor, response_mask: Tensor) -> Metrics:
    log_ratio = log_ratio.detach()
    return {
        "actor/ratio_mean": masked_mean(torch.exp(log_ratio), response_mask),
        "actor/approx_kl": masked_mean(-log_ratio, response_mask),
    }


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, response_mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Metrics]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) per token, with its clip fractions."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    detached = ratio.detach()
    high = (detached > 1.0 + clip_high) & (advantages > 0)
    low = (detached < 1.0 - clip_low) & (advantages < 0)
    metrics = {
        "actor/clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
        "actor/clipfrac_high": masked_mean(high.float(), response_mask),
        "actor/clipfrac_low": masked_mean(low.float(), response_mask),
    }
    return torch.maximum(unclipped, clipped), metrics


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Metrics]:
    """l_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)), and min(l_t, -c A) when A < 0: (B, T) -> (B, T).

    PPO (Schulman et al., arXiv 1707.06347). A larger ``clip_high`` than ``clip_low`` is DAPO's
    clip-higher (arXiv 2503.14476). ``dual_clip`` = c > 1 bounds the loss of negative-advantage
    tokens whose ratio has run far above 1 (dual-clip PPO, Ye et al., arXiv 1912.09729).
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    loss, metrics = _clipped_surrogate(
        ratio, advantages, response_mask, clip_low=clip_low, clip_high=clip_high
    )
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        metrics["actor/clipfrac_dual"] = masked_mean(dual.float(), response_mask)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, {**metrics, **_ratio_metrics(log_ratio, response_mask)}


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, Metrics]:
    """l_t = max(-A s_i, -A clip(s_i, 1 - eps_low, 1 + eps_high)), s_i = exp(mean_t log r_t): (B, T) -> (B, T).

    GSPO (Zheng et al., arXiv 2507.18071): one length-normalised importance ratio per sequence,
    clipped per sequence. Written per token as s_it = sg(s_i) * pi_t / sg(pi_t), whose value is
    s_i and whose gradient is the paper's; with one advantage per sequence this is GSPO, with
    token advantages GSPO-token. The paper aggregates with ``seq-mean-token-mean``.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1)  # (B, 1)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    loss, metrics = _clipped_surrogate(
        ratio, advantages, response_mask, clip_low=clip_low, clip_high=clip_high
    )
    metrics = {**metrics, **_ratio_metrics(log_ratio, response_mask)}
    metrics["actor/seq_ratio_mean"] = masked_mean(ratio.detach(), response_mask)
    return loss, metrics


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[Tensor, Metrics]:
    """l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi_theta(y_t): (B, T) -> (B, T).

    CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached, so
    every token keeps a gradient (unlike PPO, whose clip drops it), only its weight is bounded.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    metrics = {"actor/clipfrac": masked_mean((weight != ratio).float(), response_mask)}
    return -weight * advantages * logprobs, {**metrics, **_ratio_metrics(log_ratio, response_mask)}


def topr_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    level: Literal["token", "sequence"] = "token",
) -> tuple[Tensor, Metrics]:
    """l_t = -sg(alpha) A_t log pi_theta(y_t), alpha = 1 if A >= 0 else clip(r, 0, 1): (B, T) -> (B, T).

    TOPR (Le Roux et al., arXiv 2503.14286): positive samples get a plain SFT-like gradient,
    negative ones a truncated importance weight, so pushing down an already unlikely sequence
    stops. ``level="sequence"`` uses the paper's trajectory ratio prod_t r_t; ``"token"`` the
    per-token ratio (Trinity-RFT, ROLL).
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    if level == "sequence":
        seq = torch.where(response_mask, log_ratio, 0.0).sum(dim=-1, keepdim=True).clamp(max=20.0)
        ratio = torch.exp(seq).expand_as(log_ratio).detach()
    else:
        ratio = torch.exp(log_ratio).detach()
    negative = advantages < 0
    alpha = torch.where(negative, ratio.clamp(max=1.0), torch.ones_like(ratio))
    metrics = {"actor/clipfrac": masked_mean((negative & (ratio > 1.0)).float(), response_mask)}
    return -alpha * advantages * logprobs, {**metrics, **_ratio_metrics(log_ratio, response_mask)}


def pg_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
) -> tuple[Tensor, Metrics]:
    """l_t = -A_t r_t, whose gradient is -A_t r_t grad log pi_theta: (B, T) -> (B, T). REINFORCE (Williams, 1992).

    Vanilla (importance-weighted) policy gradient without clipping; on-policy (r = 1) its
    gradient is REINFORCE's -A grad log pi.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    metrics = {"actor/clipfrac": torch.zeros((), device=logprobs.device)}
    return -advantages * torch.exp(log_ratio), {**metrics, **_ratio_metrics(log_ratio, response_mask)}


def sft_nll(logprobs: Tensor) -> Tensor:
    """l_t = -log pi_theta(y_t): (B, T) -> (B, T). The NLL term mixed into the RL loss (e.g. LUFFY, arXiv 2504.14945)."""
    return -logprobs


def entropy_bonus(entropy: Tensor) -> Tensor:
    """l_t = -H_t: (B, T) -> (B, T); added with a positive coefficient it rewards exploration (A3C, arXiv 1602.01783)."""
    return -entropy


POLICY_LOSSES = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "topr": topr_loss,
    "pg": pg_loss,
}
