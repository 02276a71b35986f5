"""Reductions over the response mask and over prompt groups, and the one loss aggregation.

Every per-token tensor is ``(B, T)`` and comes with ``response_mask: bool[B, T]`` (True on
the response tokens whose loss counts). Values outside the mask are never read: they are
replaced by zero with ``torch.where``, so a NaN in padding cannot leak into a sum.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from torch import Tensor

from reroll.algorithms.naming import UnknownAlgorithmError, unknown_name_message

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values[mask]); over ``dim`` when given. values, mask: (B, T) -> () or reduced shape."""
    zeroed = torch.where(mask, values, torch.zeros_like(values))
    return zeroed.sum() if dim is None else zeroed.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(values[mask]) / max(|mask|, 1); over ``dim`` when given. An empty mask gives 0."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """sum_{mask} (x - mean)^2 / (n - 1), n = |mask| (Bessel); 0 when n < 2. values, mask: (B, T) -> ().

    Unbiased like every std in reroll (``group_std``, the GRPO batch std, whitening, the reward
    normalisations): one valid value has variance 0, never NaN. ``unbiased=False`` divides by n
    instead, for the population variance that ``update_running_mean_std`` merges.
    """
    mean = masked_mean(values, mask)
    count = mask.sum()
    denom = (count - 1) if unbiased else count
    sq = masked_sum((values - mean) ** 2, mask)
    return torch.where(count > 1, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + eps), mean and unbiased var over x[mask]: (B, T) -> (B, T), 0 outside the mask.

    The var divides by n - 1 (``masked_var``), so the whitened values have unbiased std 1 over the
    mask (up to eps), as with verl's ``masked_whiten``. A single valid value has var 0 (as
    ``group_std`` gives std 0 to a group of one) and whitens to 0, not NaN; verl raises instead.
    ``shift_mean=False`` adds the mean back (a single value then stays itself).
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def masked_stats(values: Tensor, mask: Tensor, *, prefix: str) -> dict[str, Tensor]:
    """``{prefix}/mean``, ``/std``, ``/max``, ``/min`` of values[mask], as metrics; zeros if empty.

    ``/std`` is unbiased (n - 1; 0 for one value), like the stds the algorithms divide by, so
    whitened (unclipped) advantages report ``adv/std`` 1 up to eps.
    """
    any_valid = mask.any()
    big = torch.finfo(values.dtype).max
    return {
        f"{prefix}/mean": masked_mean(values, mask),
        f"{prefix}/std": torch.sqrt(masked_var(values, mask)),
        f"{prefix}/max": torch.where(any_valid, torch.where(mask, values, -big).amax(), 0.0),
        f"{prefix}/min": torch.where(any_valid, torch.where(mask, values, big).amin(), 0.0),
    }


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids (B,) to dense indices 0..G-1 (B,) and the number of groups G."""
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(unique.numel())


def group_sum_count(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample sum and count of its group: values (B,), group_ids (B,) -> ((B,), (B,))."""
    index, num_groups = group_index(group_ids)
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)
    counts = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index, torch.ones_like(values)
    )
    return sums[index], counts[index]


def group_mean(values: Tensor, group_ids: Tensor) -> Tensor:
    """mean_{j in g(i)} v_j for each sample i: (B,) -> (B,)."""
    sums, counts = group_sum_count(values, group_ids)
    return sums / counts


def group_std(values: Tensor, group_ids: Tensor) -> Tensor:
    """Unbiased std of each sample's group, sqrt(sum (v_j - mean_g)^2 / (n_g - 1)): (B,) -> (B,); 0 if n_g = 1."""
    centered_sq = (values - group_mean(values, group_ids)) ** 2
    sq_sums, counts = group_sum_count(centered_sq, group_ids)
    return torch.sqrt(sq_sums / (counts - 1).clamp(min=1))


def count_tokens_and_seqs(response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(|mask|, number of sequences with at least one masked-in token): the counts ``aggregate`` divides by.

    Sum these over every micro-batch and data-parallel rank of an optimizer step (an all-reduce)
    and pass the totals to ``aggregate`` / ``actor_loss`` as ``num_tokens`` and ``num_seqs``.
    """
    return response_mask.sum(), response_mask.any(dim=-1).sum()


def aggregate(
    values: Tensor,
    response_mask: Tensor,
    *,
    mode: LossAggMode = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) over ``response_mask`` (B, T) to a scalar; modes as named in verl.

    - ``token-mean``: sum_{i,t} l_it / N_tok (DAPO's token-level loss)
    - ``seq-mean-token-mean``: sum_i (sum_t l_it / |y_i|) / N_seq (the GRPO paper)
    - ``seq-mean-token-sum``: sum_{i,t} l_it / N_seq
    - ``seq-mean-token-sum-norm``: sum_{i,t} l_it / (N_seq * L), L a constant length (Dr. GRPO, arXiv 2503.20783)

    N_tok and N_seq default to this batch's counts (``count_tokens_and_seqs``). Pass the global
    counts of the optimizer step and the losses of the micro-batches (and ranks) sum to the
    full-batch loss. ``norm_len`` defaults to T; set it to the maximum response length so that
    micro-batches padded to different lengths agree.
    """
    local_tokens, local_seqs = count_tokens_and_seqs(response_mask)
    if mode == "token-mean":
        denom = local_tokens.clamp(min=1) if num_tokens is None else num_tokens
        return masked_sum(values, response_mask) / denom
    seq_sums = masked_sum(values, response_mask, dim=-1)
    seqs = local_seqs.clamp(min=1) if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        return (seq_sums / response_mask.sum(dim=-1).clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        length = response_mask.shape[-1] if norm_len is None else norm_len
        return seq_sums.sum() / (seqs * length)
    raise UnknownAlgorithmError(unknown_name_message("loss_agg_mode", mode, list(LOSS_AGG_MODES)))


LOSS_AGG_MODES = {
    mode: partial(aggregate, mode=mode)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
}
