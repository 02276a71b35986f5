"""Context parallelism for the Megatron strategy without Transformer Engine: Ulysses attention in the
``GPTModel``'s core-attention submodule (``strategy.megatron.context_parallel``).

Megatron-Core runs its own context parallelism in Transformer Engine's attention only (its local
``DotProductAttention`` asserts ``context_parallel_size`` 1), so Megatron's context-parallel size stays
1 here and reroll forms its own groups (``reroll.strategies.context_parallel.group_ranks``, stride
``tensor_parallel``) inside Megatron's data-parallel ranks. A group of ``n`` ranks gets the same rows;
rank ``i`` runs the columns ``i w ... (i + 1) w - 1`` of every row (``ContextParallel.columns``), and:

- rotary embeddings: Megatron makes them for positions ``0 .. w - 1`` of the input it is given; the
  model's ``rotary_pos_emb`` is made to return the rank's slice of the ``n w`` positions' instead
  (``chunk_rotary``), the contiguous chunk (not Megatron's own two-chunk load-balanced layout);
- core attention (``UlyssesDotProductAttention``): queries, keys and values ``[w, b, heads, d]`` go to
  ``[n w, b, heads / n, d]`` by the all-to-alls of ``reroll.models.ulysses`` (FSDP2's, the one copy),
  Megatron's local attention runs over the whole sequence for the rank's ``1 / n`` of its TP shard's
  heads, under the whole sequence's causal mask, and the output goes back to the rank's ``w`` tokens.

Everything else acts on each token alone. The worker then gathers the group's outputs or combines its
scored tokens' log-probs (``ContextParallel.gather`` / ``combine``), so every rank of the group computes
the same loss and backpropagates it through its own columns; Megatron's DDP sums gradients over its
data-parallel ranks, the context-parallel ones among them, which adds the group's shares into the
gradient of the unsplit rows (``calculate_per_token_loss``: summed, not averaged).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention

from reroll.models.ulysses import heads_to_sequence, sequence_to_heads
from reroll.strategies.context_parallel import ContextParallel, group_ranks, split_columns


def join_groups(
    world_size: int, rank: int, size: int, tp: int, widths: Callable[[int], int] | None
) -> ContextParallel:
    """Form the role's context-parallel groups (a collective: every rank creates each, in the same order),
    ``size`` ranks ``tp`` apart: inside Megatron's data-parallel ranks, whose rank order puts the
    tensor-parallel ranks innermost, then the data-parallel ones. Returns this rank's (``widths``: the
    width its rows run at, given a caller's; ``ContextParallel``)."""
    mine = None
    for ranks in group_ranks(world_size, size, tp):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = ContextParallel(group, ranks.index(rank), size, widths)
    assert mine is not None
    return mine


def join_column_groups(world_size: int, rank: int, size: int) -> dist.ProcessGroup:
    """Form the groups of ``size`` consecutive ranks (a collective): under sequence parallelism a
    context-parallel group's ranks with their TP ranks, ``context_parallel x tensor_parallel`` in all, each
    of which runs a slice of the same rows' tokens. Returns this rank's."""
    mine = None
    for ranks in group_ranks(world_size, size):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def columns_of(
    ids: torch.Tensor, cp: ContextParallel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What the ``GPTModel`` of rank ``cp.rank`` runs for the rows ``ids`` (of the width they are split at:
    a tensor-parallel group's widest row): its columns (``split_columns``; the row padded with zeros,
    which no loss reads), their positions, the whole sequence's causal mask, and the columns' count."""
    t = ids.shape[1]
    start, stop = split_columns(t, cp.size, cp.rank)
    whole = cp.size * (stop - start)
    ids = torch.nn.functional.pad(ids, (0, whole - t))[:, start:stop]
    positions = torch.arange(start, stop, device=ids.device).expand_as(ids)
    return ids, positions, causal_mask(whole, ids.device), stop - start


def _to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's ``[s, b, h, d]`` of this rank's tokens -> ``[n s, b, h / n, d]`` (``sequence_to_heads``)."""
    return sequence_to_heads(x.permute(1, 2, 0, 3), group).permute(2, 0, 1, 3).contiguous()


def _to_sequence(x: torch.Tensor, heads: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Core attention's ``[n s, b, heads * d]`` for this rank's ``heads`` -> ``[s, b, n heads * d]``, this
    rank's tokens with every head of its TP shard (``heads_to_sequence``)."""
    length, b, hd = x.shape
    out = heads_to_sequence(x.reshape(length, b, heads, hd // heads).transpose(0, 1), group)
    return out.transpose(0, 1).reshape(length // dist.get_world_size(group), b, -1)


class UlyssesDotProductAttention(DotProductAttention):
    """Megatron-Core's local ``DotProductAttention`` over the whole sequence of a context-parallel group,
    for this rank's ``1 / n`` of its TP shard's heads (query and key-value heads alike: a query head's
    key-value head goes with it, both split in contiguous blocks). Takes and returns this rank's tokens;
    ``attention_mask`` is the whole sequence's ``[1, 1, n s, n s]``."""

    def __init__(self, *args: Any, cp: ContextParallel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cp = cp
        n = cp.size
        if self.num_attention_heads_per_partition % n or self.num_query_groups_per_partition % n:
            raise ValueError(
                f"context_parallel ({n}) must divide a TP shard's {self.num_attention_heads_per_partition} "
                f"attention and {self.num_query_groups_per_partition} key-value heads"
            )
        # what the inner attention computes after the exchange: 1/n of the shard's heads
        self.num_attention_heads_per_partition //= n
        self.num_query_groups_per_partition //= n
        self.hidden_size_per_partition //= n

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        group = self.cp.group
        q, k, v = (_to_heads(x, group) for x in (query, key, value))
        out = super().forward(q, k, v, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        return _to_sequence(out, self.num_attention_heads_per_partition, group)


def with_ulysses_attention(spec: Any, cp: ContextParallel) -> Any:
    """The layer spec ``spec`` (a ``TransformerLayer``'s ``ModuleSpec``) with its self-attention's core
    attention split over ``cp``'s group (``UlyssesDotProductAttention``), changed in place."""
    spec.submodules.self_attention.submodules.core_attention = partial(UlyssesDotProductAttention, cp=cp)
    return spec


def chunk_rotary(model: torch.nn.Module, cp: ContextParallel) -> None:
    """Make ``model``'s (a ``GPTModel``'s) rotary embedding, asked for ``w`` positions, return the
    positions ``cp.rank w ... (cp.rank + 1) w - 1`` of the group's ``cp.size w``: this rank's slice."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        raise ValueError(f"{type(model).__name__} has no rotary_pos_emb: context parallelism needs RoPE")
    whole = type(rope).forward

    def forward(max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        emb = whole(rope, max_seq_len * cp.size, *args, **kwargs)  # [n w, 1, 1, d]
        return emb[cp.rank * max_seq_len : (cp.rank + 1) * max_seq_len]

    rope.forward = forward  # an instance attribute: nn.Module's call finds it first


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """The local attention's ``[1, 1, length, length]`` causal mask (True: masked)."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)[None, None]
