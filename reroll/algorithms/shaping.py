"""Reward shaping (normalisation, clipping, DAPO's overlong penalty) and sample filters.

Shapes: ``rewards`` (B,) one scalar per sequence, ``group_ids`` (B,) the prompt of each
sample, ``response_lengths`` (B,) in tokens. A filter returns ``keep: bool[B]``; the caller
ANDs the filters and drops (or masks out) the samples with ``keep`` False. The running
statistics of ``running`` normalisation are an explicit value passed in and returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from reroll.algorithms.aggregation import group_index, group_mean, group_std, masked_mean, masked_var
from reroll.algorithms.naming import UnknownAlgorithmError, unknown_name_message

RewardNorm = Literal["none", "group", "batch", "running"]


@dataclass(frozen=True)
class RunningMeanStd:
    """Mean, population variance (divided by n, what Chan's merge needs) and count of every reward seen
    so far; scalars. ``running_normalize`` turns the variance into the unbiased std."""

    mean: Tensor
    var: Tensor
    count: Tensor

    @classmethod
    def initial(cls) -> RunningMeanStd:
        zero = torch.zeros((), dtype=torch.float64)
        return cls(mean=zero, var=torch.ones((), dtype=torch.float64), count=zero)


def update_running_mean_std(
    stats: RunningMeanStd, values: Tensor, valid: Tensor | None = None
) -> RunningMeanStd:
    """Merge the batch values[valid] into ``stats`` (Chan et al.'s parallel update); nothing to merge keeps stats."""
    valid = torch.ones_like(values, dtype=torch.bool) if valid is None else valid
    values = values.to(torch.float64)
    n = valid.sum().to(torch.float64)
    batch_mean, batch_var = masked_mean(values, valid), masked_var(values, valid, unbiased=False)
    mean, var, count = (t.to(values.device) for t in (stats.mean, stats.var, stats.count))
    total = count + n
    delta = batch_mean - mean
    share = n / total.clamp(min=1)
    new_mean = mean + delta * share
    new_var = (var * count + batch_var * n + delta**2 * count * share) / total.clamp(min=1)
    empty = n == 0
    return RunningMeanStd(
        mean=torch.where(empty, mean, new_mean), var=torch.where(empty, var, new_var), count=total
    )


def group_normalize(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """(r_i - mean_g r) / (std_g r + eps) within each prompt's group: (B,) -> (B,)."""
    return (rewards - group_mean(rewards, group_ids)) / (group_std(rewards, group_ids) + eps)


def batch_normalize(rewards: Tensor, valid: Tensor, *, eps: float = 1e-6) -> Tensor:
    """(r_i - mean r) / (std r + eps) with the statistics over rewards[valid]: (B,) -> (B,)."""
    std = torch.sqrt(masked_var(rewards, valid, unbiased=True))
    return (rewards - masked_mean(rewards, valid)) / (std + eps)


def running_normalize(
    rewards: Tensor, valid: Tensor, stats: RunningMeanStd, *, eps: float = 1e-6
) -> tuple[Tensor, RunningMeanStd]:
    """(r_i - mu) / (sigma + eps), mu and sigma over all rewards so far, this batch included: (B,) -> (B,).

    sigma is the unbiased std, sqrt(var * n / (n - 1)); 0 after a single reward (whose stored var
    is 0); before any reward, the prior ``RunningMeanStd.initial`` var of 1.
    """
    stats = update_running_mean_std(stats, rewards, valid)
    n = stats.count
    var = torch.where(n > 1, stats.var * n / (n - 1).clamp(min=1), stats.var)
    normed = (rewards - stats.mean.to(rewards.dtype)) / (torch.sqrt(var).to(rewards.dtype) + eps)
    return normed, stats


def normalize_rewards(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    mode: RewardNorm = "none",
    valid: Tensor | None = None,
    stats: RunningMeanStd | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, RunningMeanStd | None]:
    """Normalise rewards (B,) by ``mode`` in {none, group, batch, running}; returns (rewards, running stats)."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    if mode == "none":
        return rewards, stats
    if mode == "group":
        return group_normalize(rewards, group_ids, eps=eps), stats
    if mode == "batch":
        return batch_normalize(rewards, valid, eps=eps), stats
    if mode == "running":
        return running_normalize(
            rewards, valid, RunningMeanStd.initial() if stats is None else stats, eps=eps
        )
    raise UnknownAlgorithmError(unknown_name_message("reward_norm", mode, list(REWARD_NORMS)))


def clip_symmetric(values: Tensor, *, clip: float) -> Tensor:
    """clamp(x, -c, c), for reward clipping (B,) and advantage clipping (B, T)."""
    return values.clamp(min=-clip, max=clip)


def overlong_penalty(
    response_lengths: Tensor, *, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), to add to the reward: (B,) -> (B,).

    p(L) = 0 for L <= L_max - L_buf, ((L_max - L_buf) - L) / L_buf on the buffer, -1 beyond
    L_max; times ``penalty_factor``.
    """
    expected = max_len - buffer_len
    ramp = (expected - response_lengths.to(torch.float32)) / buffer_len
    return ramp.clamp(min=-1.0, max=0.0) * penalty_factor


def length_penalty(response_lengths: Tensor, *, coef: float) -> Tensor:
    """p_i = -coef * L_i, to add to the reward: (B,) -> (B,). A linear cost per response token, the
    usual guard against a learned reward model's length bias (e.g. Singhal et al., arXiv 2310.03716)."""
    return -coef * response_lengths.to(torch.float32)


def overlong_mask(response_lengths: Tensor, *, max_len: int, truncated: Tensor | None = None) -> Tensor:
    """keep_i = not truncated_i (DAPO's overlong filtering): (B,) -> bool (B,).

    ``truncated`` (the engine's finish reason was the length limit) defaults to L_i >= max_len.
    """
    return ~(response_lengths >= max_len if truncated is None else truncated)


def _group_extreme(rewards: Tensor, group_ids: Tensor, reduce: Literal["amax", "amin"]) -> Tensor:
    index, num_groups = group_index(group_ids)
    out = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    return out.scatter_reduce(0, index, rewards, reduce=reduce, include_self=False)[index]


def equal_reward_mask(rewards: Tensor, group_ids: Tensor, *, atol: float = 0.0) -> Tensor:
    """keep_i = max_g r - min_g r > atol (DAPO's dynamic sampling drops all-equal groups): (B,) -> bool (B,).

    A group whose rewards are all equal has zero advantage under any group baseline: it only
    dilutes the batch.
    """
    spread = _group_extreme(rewards, group_ids, "amax") - _group_extreme(rewards, group_ids, "amin")
    return spread > atol


def pass_rate(rewards: Tensor, group_ids: Tensor, *, correct_threshold: float = 0.5) -> Tensor:
    """Fraction of the sample's group with r > threshold: (B,) -> (B,)."""
    return group_mean((rewards > correct_threshold).to(torch.float32), group_ids)


def difficulty_mask(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    correct_threshold: float = 0.5,
    min_pass_rate: float = 0.0,
    max_pass_rate: float = 1.0,
) -> Tensor:
    """keep_i = min <= pass_rate(g(i)) <= max: drop prompts too easy or too hard: (B,) -> bool (B,)."""
    rate = pass_rate(rewards, group_ids, correct_threshold=correct_threshold)
    return (rate >= min_pass_rate) & (rate <= max_pass_rate)


def raft_mask(rewards: Tensor, *, correct_threshold: float = 0.5) -> Tensor:
    """keep_i = r_i > threshold: train on the positive samples only (RAFT++, arXiv 2504.11343): (B,) -> bool (B,)."""
    return rewards > correct_threshold


def kept_groups(keep: Tensor, group_ids: Tensor) -> Tensor:
    """Number of groups with at least one kept sample: (B,), (B,) -> () float."""
    index, num_groups = group_index(group_ids)
    kept = torch.zeros(num_groups, device=keep.device).index_add_(0, index, keep.to(torch.float32))
    return (kept > 0).sum().to(torch.float32)


def no_normalize(rewards: Tensor) -> Tensor:
    """r_i unchanged: (B,) -> (B,)."""
    return rewards


REWARD_NORMS = {
    "none": no_normalize,
    "group": group_normalize,
    "batch": batch_normalize,
    "running": running_normalize,
}
