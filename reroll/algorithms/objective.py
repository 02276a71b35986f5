"""The glue the pipeline calls: ``compute_advantages`` after a rollout, ``actor_loss`` per micro-batch.

These two read an ``AlgorithmConfig`` and call the pure functions of this package with the
config's values as keyword arguments; nothing below them sees the config. This module does
not import the config at run time (only for type hints), so ``import reroll.algorithms``
pulls in torch and nothing else of the project.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from reroll.algorithms import advantages as adv
from reroll.algorithms import shaping
from reroll.algorithms.aggregation import aggregate, group_index, masked_mean, masked_stats, masked_whiten
from reroll.algorithms.correction import rollout_is_weights
from reroll.algorithms.kl import adaptive_kl_coef, kl_penalty, kl_reward_penalty
from reroll.algorithms.losses import entropy_bonus, sft_nll
from reroll.algorithms.registry import lookup

if TYPE_CHECKING:
    from reroll.config.algorithm import AlgorithmConfig
    from reroll.data.types import TrainBatch

Metrics = dict[str, Tensor]


@dataclass(frozen=True)
class AdvantageState:
    """What ``compute_advantages`` carries from one step to the next; keep it in the trainer's checkpoint."""

    kl_coef: Tensor  # beta of the KL penalty in the reward (changes under the adaptive controller)
    reward_stats: shaping.RunningMeanStd  # for reward_norm "running"

    @classmethod
    def initial(cls, cfg: AlgorithmConfig) -> AdvantageState:
        return cls(kl_coef=torch.tensor(cfg.kl_coef), reward_stats=shaping.RunningMeanStd.initial())

    def state_dict(self) -> dict[str, Tensor]:
        """Plain tensors, loadable with ``torch.load(weights_only=True)``."""
        stats = self.reward_stats
        return {
            "kl_coef": self.kl_coef,
            "reward_mean": stats.mean,
            "reward_var": stats.var,
            "reward_count": stats.count,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> AdvantageState:
        stats = shaping.RunningMeanStd(state["reward_mean"], state["reward_var"], state["reward_count"])
        return cls(kl_coef=state["kl_coef"], reward_stats=stats)


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages (B, T), zero outside ``response_mask & keep``; the filters' ``keep`` (B,); metrics; new state."""

    advantages: Tensor
    returns: Tensor | None  # (B, T) targets for the critic (gae) or the returns (reinforce_pp, step_return)
    token_rewards: Tensor  # (B, T) shaped reward on the last token, plus the KL penalty when kl_in="reward"
    keep: Tensor  # bool (B,): False for samples a filter dropped; all True when no filter is on
    metrics: Metrics
    state: AdvantageState


def compute_advantages(
    cfg: AlgorithmConfig,
    *,
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    values: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
    response_lengths: Tensor | None = None,
    truncated: Tensor | None = None,
    max_response_len: int | None = None,
    step_ids: Tensor | None = None,
    step_rewards: Tensor | None = None,
    step_states: Tensor | None = None,
    state: AdvantageState | None = None,
) -> AdvantageResult:
    """Filters, reward shaping, KL-in-reward and the configured estimator, in that order.

    rewards (B,) float; group_ids (B,) int (the prompt of each sample); response_mask bool (B, T).
    ``logprobs``/``ref_logprobs`` (B, T): the rollout policy's and the reference's, needed when
    the KL is in the reward. ``values`` (B, T): the critic's, for gae. ``baseline_rewards``
    (B,): the greedy response's reward, for remax. ``response_lengths`` (B,) default to the
    mask's row sums; ``truncated`` (B,) bool defaults to length >= ``max_response_len``, which
    the overlong options need. ``step_ids`` (B, T) / ``step_rewards`` (B, S): turns of
    multi-turn episodes, for step_return and gigpo, which also reads ``step_states`` (B, S), the
    id of the state each turn acted in (-1: no turn). Filters and statistics are computed on the raw
    rewards of every sample; batch statistics (std, whitening) over the kept samples only.
    """
    state = AdvantageState.initial(cfg) if state is None else state
    with torch.no_grad():
        lengths = response_mask.sum(dim=-1) if response_lengths is None else response_lengths
        metrics = masked_stats(rewards.float(), torch.ones_like(rewards, dtype=torch.bool), prefix="reward")
        keep, filter_metrics = _filters(cfg, rewards, group_ids, lengths, truncated, max_response_len)
        mask = response_mask & keep.unsqueeze(-1)
        shaped, reward_stats, shape_metrics = _shape_rewards(
            cfg, rewards, group_ids, keep, lengths, max_response_len, state.reward_stats
        )
        kl_rewards, kl_coef, kl_metrics = _kl_in_reward(
            cfg, logprobs, ref_logprobs, response_mask, state.kl_coef
        )
        token_rewards = adv.outcome_to_tokens(shaped, response_mask)
        if kl_rewards is not None:
            token_rewards = token_rewards + kl_rewards
        scores = shaped if kl_rewards is None else shaped + kl_rewards.sum(dim=-1)
        inputs = adv.AdvantageInputs(
            raw_rewards=rewards,
            rewards=shaped,
            scores=scores,
            token_rewards=token_rewards,
            kl_rewards=kl_rewards,
            group_ids=group_ids,
            mask=mask,
            values=values,
            baseline_rewards=baseline_rewards,
            step_ids=step_ids,
            step_rewards=step_rewards,
            step_states=step_states,
        )
        estimator = lookup("adv_estimator", cfg.adv_estimator)
        params = {arg: getattr(cfg, field) for arg, field in ADV_ESTIMATOR_PARAMS[cfg.adv_estimator].items()}
        advantages, returns = estimator(inputs, **params)
        advantages = _post_process(cfg, advantages, mask)
    metrics.update(filter_metrics)
    metrics.update(shape_metrics)
    metrics.update(kl_metrics)
    metrics.update(_advantage_metrics(advantages, returns, mask))
    new_state = AdvantageState(kl_coef=kl_coef, reward_stats=reward_stats or state.reward_stats)
    return AdvantageResult(advantages, returns, token_rewards, keep, metrics, new_state)


def batch_advantages(
    cfg: AlgorithmConfig,
    batch: TrainBatch,
    state: AdvantageState,
    *,
    truncated: Tensor | None = None,
    max_response_len: int | None = None,
) -> AdvantageResult:
    """``compute_advantages`` on what a scored ``batch`` carries (rewards, groups, masks, the engine's
    log-probs or the old ones, the reference's, the critic's values, ReMax's baseline, the turns of
    episodes): the one call a pipeline makes after scoring."""
    logprobs = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    assert batch.rewards is not None, "batch_advantages: the batch has no rewards"
    return compute_advantages(
        cfg,
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        response_mask=batch.response_mask,
        logprobs=logprobs,
        ref_logprobs=batch.ref_logprobs,
        values=batch.values,
        baseline_rewards=batch.baseline_rewards,
        truncated=truncated,
        max_response_len=max_response_len,
        step_ids=batch.step_ids,
        step_rewards=batch.step_rewards,
        step_states=batch.step_states,
        state=state,
    )


def _filters(
    cfg: AlgorithmConfig,
    rewards: Tensor,
    group_ids: Tensor,
    lengths: Tensor,
    truncated: Tensor | None,
    max_len: int | None,
) -> tuple[Tensor, Metrics]:
    """AND of the enabled filters, and for each the number of samples it dropped."""
    masks: dict[str, Tensor] = {}
    if cfg.dynamic_sampling:
        masks["equal_reward"] = shaping.equal_reward_mask(rewards, group_ids)
    if cfg.overlong_filter:
        if truncated is None and max_len is None:
            raise ValueError(
                "algorithm.overlong_filter needs to know which responses were cut: pass truncated or "
                "max_response_len to compute_advantages"
            )
        masks["overlong"] = shaping.overlong_mask(lengths, max_len=max_len or 0, truncated=truncated)
    if cfg.positive_only:
        masks["positive_only"] = shaping.raft_mask(rewards, correct_threshold=cfg.correct_threshold)
    if cfg.difficulty_min > 0 or cfg.difficulty_max < 1:
        masks["difficulty"] = shaping.difficulty_mask(
            rewards,
            group_ids,
            correct_threshold=cfg.correct_threshold,
            min_pass_rate=cfg.difficulty_min,
            max_pass_rate=cfg.difficulty_max,
        )
    keep = torch.ones_like(rewards, dtype=torch.bool)
    metrics: Metrics = {}
    for name, mask in masks.items():
        metrics[f"filter/{name}_dropped"] = (~mask).sum().float()
        keep = keep & mask
    _, num_groups = group_index(group_ids)
    metrics["filter/kept_samples"] = keep.sum().float()
    metrics["filter/kept_frac"] = keep.float().mean()
    metrics["filter/kept_groups"] = shaping.kept_groups(keep, group_ids)
    metrics["filter/total_groups"] = torch.tensor(float(num_groups))
    return keep, metrics


def _shape_rewards(
    cfg: AlgorithmConfig,
    rewards: Tensor,
    group_ids: Tensor,
    keep: Tensor,
    lengths: Tensor,
    max_len: int | None,
    stats: shaping.RunningMeanStd,
) -> tuple[Tensor, shaping.RunningMeanStd | None, Metrics]:
    """Overlong penalty, then normalisation, then clipping, then the length penalty."""
    shaped = rewards.float()
    metrics: Metrics = {}
    if cfg.overlong_shaping:
        if max_len is None:
            raise ValueError(
                "algorithm.overlong_shaping ramps the penalty up to the length limit: pass max_response_len "
                "to compute_advantages"
            )
        penalty = shaping.overlong_penalty(
            lengths,
            max_len=max_len or 0,
            buffer_len=cfg.overlong_buffer_len,
            penalty_factor=cfg.overlong_penalty,
        )
        shaped = shaped + penalty
        metrics["reward/overlong_penalty_mean"] = penalty.mean()
        metrics["reward/overlong_frac"] = (penalty < 0).float().mean()
    shaped, new_stats = shaping.normalize_rewards(
        shaped, group_ids, mode=cfg.reward_norm, valid=keep, stats=stats, eps=cfg.adv_eps
    )
    if cfg.reward_clip is not None:
        metrics["reward/clip_frac"] = (shaped.abs() > cfg.reward_clip).float().mean()
        shaped = shaping.clip_symmetric(shaped, clip=cfg.reward_clip)
    if cfg.length_penalty:
        penalty = shaping.length_penalty(lengths, coef=cfg.length_penalty)
        shaped = shaped + penalty
        metrics["reward/length_penalty_mean"] = penalty.mean()
    metrics["reward/shaped_mean"] = masked_mean(shaped, keep)
    return shaped, new_stats, metrics


def _kl_in_reward(
    cfg: AlgorithmConfig,
    logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    response_mask: Tensor,
    kl_coef: Tensor,
) -> tuple[Tensor | None, Tensor, Metrics]:
    """The penalty -beta * KL_t (B, T) when the KL is in the reward, the next beta, and the KL metrics."""
    if cfg.kl_in != "reward" or cfg.kl_coef == 0:
        return None, kl_coef, {}
    if logprobs is None or ref_logprobs is None:
        raise ValueError(
            f"algorithm.kl_in is 'reward' with kl_coef {cfg.kl_coef}, so compute_advantages needs logprobs "
            "and ref_logprobs: pass both, or set algorithm.kl_in to 'loss' or kl_coef to 0"
        )
    kl_coef = kl_coef.to(logprobs.device)
    penalty, kl = kl_reward_penalty(
        logprobs, ref_logprobs, response_mask, kl_coef=kl_coef, estimator=cfg.kl_estimator
    )
    per_seq = masked_mean(kl, response_mask, dim=-1)
    current = masked_mean(per_seq, response_mask.any(dim=-1))
    next_coef = kl_coef
    if cfg.kl_controller == "adaptive":
        next_coef = adaptive_kl_coef(
            kl_coef, current, target=cfg.kl_target, horizon=cfg.kl_horizon, n_steps=response_mask.shape[0]
        )
    return penalty, next_coef, {"kl/reward_kl": current, "kl/coef": kl_coef.detach().float()}


def _post_process(cfg: AlgorithmConfig, advantages: Tensor, mask: Tensor) -> Tensor:
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask, eps=cfg.adv_eps)
    if cfg.adv_clip is not None:
        advantages = shaping.clip_symmetric(advantages, clip=cfg.adv_clip)
    return torch.where(mask, advantages, 0.0)


def _advantage_metrics(advantages: Tensor, returns: Tensor | None, mask: Tensor) -> Metrics:
    metrics = masked_stats(advantages, mask, prefix="adv")
    if returns is not None:
        metrics["returns/mean"] = masked_mean(returns, mask)
    return metrics


# estimator name -> {keyword argument of the estimate_* function: config field}
ADV_ESTIMATOR_PARAMS: dict[str, dict[str, str]] = {
    "gae": {"gamma": "gamma", "lam": "lam"},
    "grpo": {"std_scale": "std_scale", "eps": "adv_eps"},
    "rloo": {},
    "reinforce_pp": {"gamma": "gamma"},
    "reinforce_pp_baseline": {"gamma": "gamma"},
    "remax": {},
    "raft": {"correct_threshold": "correct_threshold"},
    "step_return": {"gamma": "gamma"},
    "gigpo": {
        "gamma": "gamma",
        "step_weight": "gigpo_step_weight",
        "std_scale": "std_scale",
        "eps": "adv_eps",
    },
}

# policy loss name -> {keyword argument of the loss function: config field}
POLICY_LOSS_PARAMS: dict[str, dict[str, str]] = {
    "ppo_clip": {"clip_low": "clip_low", "clip_high": "clip_high", "dual_clip": "dual_clip"},
    "gspo": {"clip_low": "clip_low", "clip_high": "clip_high"},
    "cispo": {"clip_low": "clip_low", "clip_high": "clip_high"},
    "topr": {"level": "topr_level"},
    "pg": {},
}


def actor_loss(
    cfg: AlgorithmConfig,
    *,
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    response_mask: Tensor,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    sft_mask: Tensor | None = None,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    kl_coef: float | None = None,
    max_response_len: int | None = None,
) -> tuple[Tensor, Metrics]:
    """L = agg(w * l_pg + beta * KL - c_H * H + c_sft * NLL * sft_mask) over ``response_mask``; (B, T) -> ().

    ``logprobs`` (B, T) with gradient; ``old_logprobs`` (B, T) of the policy the advantages
    belong to (None: on-policy, ``logprobs.detach()``); ``entropy`` (B, T) with gradient, for
    the bonus; ``rollout_logprobs`` (B, T) from the inference engine, for ``rollout_is``;
    ``sft_mask`` bool (B, T) selects the NLL tokens (default: all response tokens). ``w`` is
    the rollout importance weight (1 when off). ``num_tokens`` / ``num_seqs``: the global
    counts of the optimizer step (``count_tokens_and_seqs`` summed over micro-batches and
    ranks); with them, the micro-batch losses add up to the full-batch loss (with DDP/FSDP
    gradient averaging, scale by the world size). ``kl_coef`` overrides ``cfg.kl_coef``.
    Term metrics (``actor/pg_loss``, ``actor/kl_loss``, ``actor/sft_loss``, ``actor/loss``)
    are this micro-batch's share; ratio metrics are means over its tokens.
    """
    old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs
    params = {arg: getattr(cfg, field) for arg, field in POLICY_LOSS_PARAMS[cfg.policy_loss].items()}
    policy_fn = lookup("policy_loss", cfg.policy_loss)
    token_loss, metrics = policy_fn(logprobs, old_logprobs, advantages, response_mask, **params)
    if cfg.rollout_is != "none":
        token_loss, is_metrics = _rollout_correction(
            cfg, token_loss, old_logprobs, rollout_logprobs, response_mask
        )
        metrics.update(is_metrics)
    norm_len = cfg.loss_norm_len or max_response_len
    agg = partial(
        aggregate,
        response_mask=response_mask,
        mode=cfg.loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_len=norm_len,
    )
    metrics["actor/pg_loss"] = agg(token_loss.detach())
    beta = cfg.kl_coef if kl_coef is None else kl_coef
    kl_term = _kl_term(cfg, logprobs, ref_logprobs, response_mask, beta, metrics)
    if kl_term is not None:
        metrics["actor/kl_loss"] = agg(kl_term.detach()) / beta
        token_loss = token_loss + kl_term
    token_loss = token_loss + _entropy_term(cfg, entropy, response_mask, metrics)
    if cfg.sft_coef > 0:
        nll = sft_nll(logprobs)
        nll = nll if sft_mask is None else torch.where(sft_mask, nll, 0.0)
        metrics["actor/sft_loss"] = agg(nll.detach())
        token_loss = token_loss + cfg.sft_coef * nll
    loss = agg(token_loss)
    metrics["actor/loss"] = loss.detach()
    return loss, metrics


def _kl_term(
    cfg: AlgorithmConfig,
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    response_mask: Tensor,
    beta: float,
    metrics: Metrics,
) -> Tensor | None:
    """beta * KL_t when the KL is in the loss (else None); records ``actor/kl`` whenever ref_logprobs is given."""
    in_loss = cfg.kl_in == "loss" and beta > 0
    if ref_logprobs is None:
        if in_loss:
            raise ValueError(
                f"algorithm.kl_in is 'loss' with kl_coef {beta}, so actor_loss needs ref_logprobs: pass them, "
                "or set algorithm.kl_coef to 0"
            )
        return None
    kl = kl_penalty(logprobs, ref_logprobs, estimator=cfg.kl_estimator)
    metrics["actor/kl"] = masked_mean(kl.detach(), response_mask)
    return beta * kl if in_loss else None


def _entropy_term(
    cfg: AlgorithmConfig, entropy: Tensor | None, response_mask: Tensor, metrics: Metrics
) -> Tensor:
    """-c_H * H per token (0 without a coefficient); records ``actor/entropy`` whenever entropy is given."""
    if entropy is None:
        if cfg.entropy_coef > 0:
            raise ValueError(
                f"algorithm.entropy_coef is {cfg.entropy_coef}, so actor_loss needs the per-token entropy: "
                "pass entropy (B, T), or set entropy_coef to 0"
            )
        return torch.zeros((), device=response_mask.device)
    metrics["actor/entropy"] = masked_mean(entropy.detach(), response_mask)
    if cfg.entropy_coef == 0:
        return torch.zeros((), device=entropy.device)
    return cfg.entropy_coef * entropy_bonus(entropy)


def _rollout_correction(
    cfg: AlgorithmConfig,
    token_loss: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor | None,
    response_mask: Tensor,
) -> tuple[Tensor, Metrics]:
    if rollout_logprobs is None:
        raise ValueError(
            f"algorithm.rollout_is is {cfg.rollout_is!r}, so actor_loss needs the inference engine's "
            "rollout_logprobs: pass them, or set algorithm.rollout_is to 'none'"
        )
    weights, metrics = rollout_is_weights(
        old_logprobs.detach(),
        rollout_logprobs,
        response_mask,
        level=cfg.rollout_is,
        mode=cfg.rollout_is_mode,
        max_weight=cfg.rollout_is_max,
        min_weight=cfg.rollout_is_min,
    )
    return token_loss * weights, metrics
