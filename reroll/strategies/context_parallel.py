"""Context parallelism: each rank of a group of ``strategy.context_parallel`` ranks runs 1/n of every
sequence's tokens, its attention over the whole sequence by Ulysses all-to-alls (``reroll.models.ulysses``).

The role's ``world_size`` ranks form groups of ``n`` ranks ``stride`` apart: consecutive ranks (``0..n-1``,
``n..2n-1``, ...) for fsdp2 (stride 1); for megatron, stride ``tensor_parallel``, so that a group's ranks
hold the same tensor-parallel shard (``group_ranks``). A group is one data-parallel part: its ranks get
the same rows and run the same micro-batches. A row of
``W`` tokens (a micro-batch's padded rows, or its packed row) is padded to ``n * w`` and rank ``i`` runs
the columns ``i w ... (i + 1) w - 1`` (``columns``). Targets are read from the whole row before it is
split, so a log-prob whose next token lies on the next rank's slice needs no exchange.

What the ranks of a group compute comes back whole to each of them, differentiably: per-token outputs
by an all-gather whose backward takes the rank's own slice of the gradient (``gather``), scored tokens'
log-probs by a sum of each rank's share whose backward passes the gradient through (``combine``).
Every rank of the group then computes the same loss from the same tensors, and the gradient of that
loss through its own slice is its share: FSDP2's sum over all ranks of the role (the group's shares,
then the data-parallel ranks') is the gradient of the unsplit batch, with no rescaling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reroll.data.transfer import to_device
from reroll.models.loading import position_ids_from
from reroll.models.packed_attention import packed_kwargs


def group_ranks(world_size: int, size: int, stride: int = 1) -> list[list[int]]:
    """The role's context-parallel groups: ``size`` ranks ``stride`` apart each, within consecutive blocks
    of ``size * stride`` ranks (stride 1: consecutive ranks, on GPUs one node's)."""
    if size < 1 or stride < 1 or world_size % (size * stride):
        raise ValueError(
            f"world_size ({world_size}) must be a multiple of context_parallel ({size}) x {stride}"
        )
    block = size * stride
    return [
        [start + t + stride * c for c in range(size)]
        for start in range(0, world_size, block)
        for t in range(stride)
    ]


def data_shards(shards: list[Any], size: int, stride: int = 1) -> list[Any]:
    """Each rank's share, given each data-parallel part's (``world_size / size`` of them): the ranks of a
    group (``group_ranks``) get the same one, the groups' in the order of their first ranks."""
    world = len(shards) * size
    return [shards[r % stride + stride * (r // (size * stride))] for r in range(world)]


def group_leaders(parts: list[Any], size: int, stride: int = 1) -> list[Any]:
    """One result per group (its first rank's) from every rank's: the ranks of a group return the same."""
    return [part for r, part in enumerate(parts) if (r // stride) % size == 0]


class _Gather(torch.autograd.Function):
    """All-gather along dim 1 in rank order; the backward pass keeps the rank's own slice of the
    gradient (every rank's gradient of the gathered tensor is the same: they compute the same loss)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, rank: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = ctx.rank * ctx.width
        return grad[:, start : start + ctx.width], None, None


class _Sum(torch.autograd.Function):
    """The sum over the group's ranks of their shares (each zero where another rank's values go); the
    backward pass hands the gradient through as it is (the same on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@dataclass(frozen=True)
class LocalPicks:
    """Scored positions of a flattened ``(rows, W)`` model input that fall on this rank's slice:
    ``positions`` in the flattened ``(rows, w)`` slice, ``keep`` which of the ``count`` positions."""

    positions: torch.Tensor
    keep: torch.Tensor
    count: int


def split_columns(width: int, size: int, rank: int) -> tuple[int, int]:
    """The columns ``[start, stop)`` of a ``width``-token row (padded to a multiple of ``size``) that rank
    ``rank`` of ``size`` runs."""
    w = -(-width // size)
    return rank * w, (rank + 1) * w


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its context-parallel group: ``rank`` of ``size``, talking over ``group``.
    ``widths``: the width the model's rows are split at, given a caller's rows' (None: theirs; the
    Megatron strategy runs a tensor-parallel group's rows together, at the widest of theirs)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    widths: Callable[[int], int] | None = None

    def columns(self, width: int) -> tuple[int, int]:
        """The columns ``[start, stop)`` of a ``width``-token row this rank runs (``split_columns`` of the
        width the model's rows are split at: a collective where ``widths`` is set)."""
        return split_columns(width if self.widths is None else self.widths(width), self.size, self.rank)

    def local(self, x: torch.Tensor, fill: torch.Tensor | int) -> torch.Tensor:
        """This rank's columns of ``(rows, W, ...)`` ``x``, padded with ``fill`` (a value, or a row of the
        padding's values) past ``W``."""
        start, stop = self.columns(x.shape[1])
        pad = self.size * (stop - start) - x.shape[1]
        if pad:
            extra = fill if isinstance(fill, torch.Tensor) else torch.full((pad,), fill, dtype=x.dtype)
            x = torch.cat([x, extra.to(x.device, x.dtype).expand(x.shape[0], pad, *x.shape[2:])], dim=1)
        return x[:, start:stop]

    def forward(
        self,
        model: Any,
        device: torch.device,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """``model``'s output on this rank's columns of right-padded rows (``attention_mask``) or a packed
        row (``position_ids``, no mask): ``(rows, w, ...)``. The packed row's bounds over the whole padded
        row go along (``packed_kwargs``: the padding is a row of its own); padded rows attend causally."""
        if attention_mask is not None and position_ids is None:
            position_ids = position_ids_from(attention_mask)
        start, stop = self.columns(input_ids.shape[1])
        pad = self.size * (stop - start) - input_ids.shape[1]
        restart = torch.arange(pad, dtype=position_ids.dtype)  # positions of the padding: a row apart
        bounds = {}
        if attention_mask is None:
            whole = torch.cat([position_ids.cpu(), restart.expand(position_ids.shape[0], pad)], dim=1)
            bounds = packed_kwargs(whole, device)
        out = model(
            input_ids=to_device(self.local(input_ids, 0), device),
            attention_mask=None,
            position_ids=to_device(self.local(position_ids, restart), device),
            **bounds,
        )
        return out.logits

    def gather(self, local: torch.Tensor, width: int) -> torch.Tensor:
        """The group's outputs ``(rows, w, ...)`` as the whole rows' ``(rows, width, ...)`` (differentiable)."""
        return _Gather.apply(local, self.group, self.rank)[:, :width]

    def picks(self, picked: torch.Tensor, width: int) -> LocalPicks:
        """Which of ``picked`` (positions in a flattened ``(rows, width)`` input) this rank runs, and where
        they sit in its flattened slice."""
        start, stop = self.columns(width)
        rows, cols = picked // width, picked % width
        keep = (cols >= start) & (cols < stop)
        return LocalPicks(rows[keep] * (stop - start) + cols[keep] - start, keep, picked.numel())

    def combine(self, values: torch.Tensor, picks: LocalPicks) -> torch.Tensor:
        """The ``(count,)`` values of every scored position from each rank's ``values`` of its own
        (``picks.keep``), in the order of ``picked`` (differentiable)."""
        kept = to_device(picks.keep.nonzero().squeeze(-1), values.device)  # on the host: size known
        share = values.new_zeros(picks.count).index_put((kept,), values)
        return _Sum.apply(share, self.group)
