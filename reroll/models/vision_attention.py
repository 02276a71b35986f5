"""The vision tower's attention over many images and windows in a few ``scaled_dot_product_attention``
calls, not one call per image or window.

A Qwen2-VL-family vision tower runs its patches of all images as one sequence, split into segments by
``cu_seqlens``: each image (Qwen2-VL, and Qwen2.5-VL's full-attention blocks) or each window of an image
(Qwen2.5-VL's other blocks: 112-pixel windows, 64 patches) attends within itself. transformers' vision
attention hands those bounds to a flash-attention (varlen) implementation; for any other one (``sdpa``,
``eager``) it splits the sequence and calls the attention once per segment in a Python loop, after a
``lengths.tolist()`` host sync. Sixteen 448-pixel images are 256 windows: 256 small calls a windowed
block, ~7,000 a forward of Qwen2.5-VL-3B's tower, again in the recompute and the backward.

``attend_segments_batched(model)`` registers ``attention`` below and sets it on the model's vision config
only (the text model keeps its own); the trainers call it at load (``use_kernels``, unless
``model.batched_vision_attention`` is false). It does, with torch's SDPA and no flash-attn package, what the loop
does: segments of equal length are gathered into one ``(segments, heads, length, head_dim)`` batch and run
in one non-causal SDPA call per distinct length, and the outputs are put back in the sequence's order.
Each segment attends over exactly its own keys, as in the loop; the kernel sees a batch instead of one
segment a call and may order its sums differently, so results agree with the loop's to fp32 rounding
(~1e-7 to 1e-6 relative, ``tests/unit/test_vision_attention.py``).

Routing: transformers decides by the implementation's *name* whether to pass the bounds
(``is_flash_attention_requested``: "flash" in the name), so the name below holds "flash" although no
flash-attn kernel runs; with it the vision attention passes ``cu_seq_lens_q`` / ``max_length_q`` (and the
tower computes each ``max_seqlen`` once a forward, one host sync). Should a transformers release stop
passing the bounds, ``attention`` is called per segment and runs that segment's SDPA: still correct,
only as slow as before. A registered attention function, rather than a replaced forward, keeps
transformers' own projections, rotary embedding and output layout: only the attention is ours.

The gather indices are built once per ``cu_seqlens`` tensor (the tower makes one for its windowed blocks
and one for its full blocks a forward) and reused by every block and its recompute (activation
checkpointing passes the same tensor): one host read of the bounds per tensor, none per block.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch

# "flash" routes transformers' vision attention to its varlen branch (see the module docstring)
NAME = "reroll_segments_sdpa_flash_api"


def attend_segments_batched(model: torch.nn.Module) -> bool:
    """Switch ``model``'s vision tower (a transformers vision-language model, or one wrapping it) from
    ``sdpa``'s per-segment loop to ``attention``; its text model is left as it is. Returns whether it
    did (``switch_vision_config``; False for a model without a vision config). Call it after anything
    that sets the whole model's attention (``attend_rows_apart``): transformers' setter passes a model
    config's implementation on to its vision config."""
    from reroll.models.vision import vision_tower

    config = getattr(getattr(model, "config", None), "vision_config", None)
    if config is None:
        return False
    tower = getattr(vision_tower(model), "config", config)  # the same object in transformers 5.x
    return all([switch_vision_config(c) for c in {id(config): config, id(tower): tower}.values()])


def switch_vision_config(config: Any) -> bool:
    """Set a vision tower's config (``model.visual.config``, which its blocks read) to ``attention``, where it runs sdpa; one on another implementation (eager,
    flash-attn) is left as it is. Returns whether it runs ``attention`` now."""
    from reroll.models.packed_attention import NAME as PACKED

    # packed attention, set on a whole model's config, reaches the vision config too: there it is sdpa
    if getattr(config, "_attn_implementation", None) not in ("sdpa", PACKED, NAME):
        return False
    _register()
    config._attn_implementation = NAME
    return True


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call from a vision block: ``query`` / ``key`` / ``value`` ``(1, heads, N,
    head_dim)``, the segments' bounds ``cu_seq_lens_q`` ``(segments + 1,)``; returns ``(1, N, heads,
    head_dim)``. Without bounds (a single segment) it is transformers' ``sdpa``."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if attention_mask is not None or query.shape[0] != 1 or kwargs.get("is_causal"):
        raise ValueError("vision segment attention: expected one non-causal packed sequence without a mask")
    shared = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q  # as the vision blocks pass them
    if not shared and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("vision segment attention: queries and keys must share their segments")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (N, heads, head_dim)
    out = segments_attention(q, k, v, cu_seq_lens_q, scale=scaling, dropout=dropout)
    return out[None], None


def segments_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Non-causal attention of each segment ``cu_seqlens[i]:cu_seqlens[i+1]`` of ``q`` / ``k`` / ``v``
    ``(N, heads, head_dim)`` within itself; ``(N, heads, head_dim)``. One SDPA call per distinct segment
    length."""
    plan = _plan(cu_seqlens)
    parts = []
    for group in plan.groups:
        q_, k_, v_ = (group.take(x).transpose(1, 2) for x in (q, k, v))  # (segments, heads, L, head_dim)
        o = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, dropout_p=dropout, scale=scale)
        parts.append(o.transpose(1, 2).reshape(group.rows, *q.shape[1:]))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if plan.inverse is None else out.index_select(0, plan.inverse)


@dataclass(frozen=True)
class _Group:
    """The segments of one length: ``count`` of ``length`` rows, at ``rows[start:stop]`` where they lie
    end to end (``index`` None), else gathered by ``index`` ``(count * length,)``."""

    length: int
    count: int
    start: int
    index: torch.Tensor | None

    @property
    def rows(self) -> int:
        return self.count * self.length

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This group's rows of ``x`` ``(N, ...)`` as ``(count, length, ...)``."""
        rows = x[self.start : self.start + self.rows] if self.index is None else x.index_select(0, self.index)
        return rows.reshape(self.count, self.length, *x.shape[1:])


@dataclass(frozen=True)
class _Plan:
    """The groups in the order their outputs are concatenated, and the permutation that puts the
    concatenation back in the sequence's order (None where it already is)."""

    groups: tuple[_Group, ...]
    inverse: torch.Tensor | None


def plan_segments(bounds: list[int], device: torch.device | str = "cpu") -> _Plan:
    """The gather plan of segments with boundaries ``bounds`` (``cu_seqlens`` as a list), by length."""
    by_length: dict[int, list[int]] = {}
    for a, b in itertools.pairwise(bounds):
        if b > a:  # an empty segment attends to nothing and writes nothing
            by_length.setdefault(b - a, []).append(a)
    groups, order = [], []
    for length, starts in sorted(by_length.items()):
        end_to_end = all(s == starts[0] + i * length for i, s in enumerate(starts))
        index = (torch.tensor(starts)[:, None] + torch.arange(length)[None, :]).reshape(-1)
        order.append(index)
        gather = None if end_to_end else index.to(device)
        groups.append(_Group(length, len(starts), starts[0], gather))
    perm = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    if bounds[0] != 0 or perm.numel() != bounds[-1]:
        raise ValueError(f"cu_seqlens must start at 0 and not decrease; got {bounds[:4]}...{bounds[-2:]}")
    in_order = torch.equal(perm, torch.arange(perm.numel()))
    return _Plan(tuple(groups), None if in_order else torch.argsort(perm).to(device))


# The plans of the last few ``cu_seqlens`` tensors, by identity: the tower passes the same tensor to all
# its windowed (or full) blocks, again in their recompute and backward. The weak reference and the
# tensor's version counter make a reused id or an in-place change a miss, never a stale plan.
_PLANS: dict[int, tuple[weakref.ref, int, _Plan]] = {}
_KEEP = 8


def _plan(cu_seqlens: torch.Tensor) -> _Plan:
    key = id(cu_seqlens)
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    plan = plan_segments(cu_seqlens.tolist(), cu_seqlens.device)  # the one host read of these bounds
    if len(_PLANS) >= _KEEP:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, plan)
    return plan
