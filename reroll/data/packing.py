"""Micro-batches by a token budget, and packing a micro-batch's rows into one sequence without padding.

``micro_batches`` cuts a ``TrainBatch`` into contiguous micro-batches (row order kept, so per-row results
concatenate back), each trimmed to its longest row. ``pack`` lays the real tokens of a micro-batch's rows
end to end in one ``(1, L)`` row whose ``position_ids`` restart at 0 at each row; ``unpack`` puts a
per-token output of that row back into right-padded ``(B, T, ...)`` form, zeros on the padding.

A model attends only within each packed row when given those ``position_ids`` and no attention mask:
transformers' ``masking_utils.find_packed_sequence_indices`` reads the restarts of ``position_ids`` and
builds a block-diagonal causal mask (sdpa and eager; tests/unit/test_packing.py checks the logits).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from reroll.data.transfer import to_device
from reroll.data.types import TrainBatch


def micro_batches(
    batch: TrainBatch, *, max_rows: int | None, max_tokens: int | None, count: int | None = None
) -> list[TrainBatch]:
    """Contiguous micro-batches of at most ``max_rows`` rows and ``max_tokens`` real tokens, each trimmed.

    Real tokens are a row's ``attention_mask`` count (padding is not counted; without packing the
    forward still runs on rows x the longest row). Rows are taken in order and a micro-batch is closed
    when the next row would pass either limit; a row longer than ``max_tokens`` gets a micro-batch of its
    own. ``None`` lifts a limit; at least one must be set. ``count``: exactly this many micro-batches
    (``to_count``; ranks of a sharded strategy must run equally many forwards). ``num_tokens`` /
    ``num_seqs`` are kept (they describe the whole step), so micro-batch losses add up to the step's.
    """
    if max_rows is None and max_tokens is None:
        raise ValueError("micro_batches: set max_rows (optim.micro_batch_size) or max_tokens, or both")
    for name, value in (("max_rows", max_rows), ("max_tokens", max_tokens)):
        if value is not None and value < 1:
            raise ValueError(
                f"micro_batches: {name} is {value}; it must be at least 1 (or None for no limit)"
            )
    lengths = batch.attention_mask.sum(-1).tolist()
    bounds, rows, tokens = [0], 0, 0
    for i, n in enumerate(lengths):
        full_rows = max_rows is not None and rows + 1 > max_rows
        full_tokens = max_tokens is not None and tokens + n > max_tokens
        if rows and (full_rows or full_tokens):
            bounds.append(i)
            rows, tokens = 0, 0
        rows, tokens = rows + 1, tokens + n
    if len(batch):
        bounds.append(len(batch))
    if count is not None:
        bounds = to_count(bounds, lengths, count)
    return [batch.select(slice(a, b)).trim() for a, b in itertools.pairwise(bounds)]


def length_order(batch: TrainBatch) -> torch.Tensor:
    """Row indices by real length (``attention_mask`` count), longest first, ties in row order.

    Micro-batches cut from the rows in this order hold rows of similar length, so a micro-batch trimmed
    to its longest row computes little padding (on a long-tailed RL batch, about half the tokens of
    micro-batches cut in row order); the first micro-batch is the largest, so one that does not fit in
    memory fails at once."""
    return torch.argsort(batch.attention_mask.sum(-1), descending=True, stable=True)


def to_count(bounds: list[int], lengths: list[int], count: int) -> list[int]:
    """Micro-batch boundaries (row indices, 0 ... B) moved to give exactly ``count`` micro-batches.

    While too few, the micro-batch with the most real tokens (of 2 rows or more) is halved by rows; while
    too many, the two neighbours with the fewest tokens together are merged (that one may pass the token
    budget). ``lengths``: real tokens per row.
    """
    rows = len(lengths)
    if not 1 <= count <= rows:
        raise ValueError(
            f"cannot cut {rows} rows into {count} micro-batches: every rank of a role needs at least one row "
            "(the batch has fewer rows than ranks); use a larger rollout batch or fewer ranks"
        )
    bounds = list(bounds)
    cum = list(itertools.accumulate(lengths, initial=0))
    tokens = lambda a, b: cum[b] - cum[a]  # noqa: E731
    while len(bounds) - 1 < count:
        spans = [(tokens(a, b), i) for i, (a, b) in enumerate(itertools.pairwise(bounds)) if b - a > 1]
        _, i = max(spans)
        bounds.insert(i + 1, (bounds[i] + bounds[i + 1]) // 2)
    while len(bounds) - 1 > count:
        _, i = min((tokens(bounds[i - 1], bounds[i + 1]), i) for i in range(1, len(bounds) - 1))
        del bounds[i]
    return bounds


@dataclass(frozen=True)
class Packed:
    """A micro-batch's real tokens end to end in one row.

    ``input_ids`` / ``position_ids``: ``(1, L)``, positions 0, 1, ... restarting at each row.
    ``cu_seqlens``: ``(B + 1,)`` int32 start offsets of the rows in the packed row (flash-attention's form).
    ``rows`` / ``cols``: ``(L,)`` where each packed token sits in the padded ``(B, T)`` layout.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    num_rows: int


def pack(mb: TrainBatch) -> Packed:
    """The real tokens (``attention_mask``) of ``mb``'s rows concatenated in row order into one ``(1, L)`` row."""
    mask = mb.attention_mask.bool()
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: row 0's tokens, then row 1's, ...
    if rows.numel() == 0:
        raise ValueError(
            f"pack: the micro-batch of {len(mb)} rows has no real tokens (attention_mask is all False)"
        )
    lengths = mask.sum(-1)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    positions = mask.long().cumsum(-1)[rows, cols] - 1  # 0, 1, ... over each row's real tokens
    return Packed(
        input_ids=mb.input_ids[rows, cols][None],
        position_ids=positions[None],
        cu_seqlens=cu_seqlens,
        rows=rows,
        cols=cols,
        num_rows=len(mb),
    )


def unpack(x: torch.Tensor, packed: Packed, width: int) -> torch.Tensor:
    """A packed row's per-token output ``(1, L, ...)`` back to right-padded ``(B, width, ...)``, zeros on padding.

    Differentiable: the gradient flows back to ``x`` on the real tokens.
    """
    if x.shape[:2] != (1, packed.rows.numel()):
        raise ValueError(
            f"unpack: expected an output of shape (1, {packed.rows.numel()}, ...) for the packed row, "
            f"got {tuple(x.shape)}"
        )
    out = x.new_zeros((packed.num_rows, width, *x.shape[2:]))
    out[to_device(packed.rows, x.device), to_device(packed.cols, x.device)] = x[0]
    return out


def padding_stats(parts: list[TrainBatch], *, packed: bool) -> dict[str, int]:
    """Real tokens, and the padding tokens the forwards of ``parts`` compute (zero when packed)."""
    real = sum(int(p.attention_mask.sum()) for p in parts)
    computed = real if packed else sum(p.attention_mask.numel() for p in parts)
    return {"tokens": real, "padding": computed - real, "micro_batches": len(parts)}
