"""Ulysses sequence parallelism for transformers models: attention over the whole sequence while each
rank of a group holds a contiguous slice of its tokens (DeepSpeed-Ulysses, Jacobs et al. 2023,
arXiv:2309.14509).

Every layer but attention acts on each token alone, so a rank runs embeddings, norms, MLPs and the head
on its slice only. ``use_ulysses(model, group)`` switches the model's attention to one registered here,
which around the model's own kernel does two all-to-alls in the group of ``n`` ranks:

- before: queries, keys and values ``(b, heads, s, d)`` of the rank's ``s`` tokens become
  ``(b, heads / n, n * s, d)``: every token of the sequence, for the rank's ``1 / n`` of the heads;
- attention over the whole sequence for those heads: causal, each packed row apart where the forward
  carries a packed row's bounds (``cu_seq_lens_q``: ``packed_attention``), else sdpa's causal kernel;
- after: the output ``(b, n * s, heads / n, d)`` goes back to ``(b, s, heads, d)``, the rank's tokens.

Both all-to-alls are differentiable (an all-to-all's adjoint is itself), so the backward pass, and an
activation-checkpointed layer's recompute, exchange gradients the same way. Attention is causal and
takes no padding mask: rows are right-padded, so a real token's keys (all before it) are real tokens
and attend as under the mask; padding positions compute values no loss reads. Models with
sliding-window or soft-capped attention are refused.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from reroll.config.startable import ulysses_model_problems
from reroll.errors import UserError

NAME = "reroll_ulysses"
_names = itertools.count()


class _AllToAll(torch.autograd.Function):
    """``x`` ``(n, ...)``: chunk ``j`` goes to rank ``j``; the output's chunk ``i`` came from rank ``i``.
    The backward pass does the same to the gradient (the exchange is its own adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()  # (an output shaped like a transposed input would keep its strides)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(b, h, s, d)`` of this rank's ``s`` tokens -> ``(b, h / n, n * s, d)``: the whole sequence (ranks'
    slices in rank order) for this rank's ``1 / n`` of the heads (rank ``i``: heads ``i h/n ... ``)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    chunks = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # chunk j: heads for rank j
    got = _AllToAll.apply(chunks, group)  # chunk i: rank i's tokens, this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse for attention's output: ``(b, n * s, h / n, d)`` -> ``(b, s, h, d)``, this rank's tokens
    with every head."""
    n = dist.get_world_size(group)
    b, length, h, d = x.shape
    s = length // n
    chunks = x.reshape(b, n, s, h, d).transpose(0, 1)  # chunk j: rank j's tokens
    got = _AllToAll.apply(chunks, group)  # chunk i: rank i's heads of this rank's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, n * h, d)


def use_ulysses(model: torch.nn.Module, group: dist.ProcessGroup) -> str:
    """Switch ``model`` (a transformers model, or one wrapping it) to attention split over ``group``'s
    ranks; returns the name its attention is registered under (one per call: a process may hold
    models of several groups). A ``UserError`` where the model cannot (``ulysses_model_problems``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = model.config
    size = dist.get_world_size(group)
    problems = ulysses_model_problems(config, size)
    if config._attn_implementation not in ("sdpa", "reroll_packed"):
        problems.append(
            f"strategy.context_parallel wraps sdpa attention; the model runs {config._attn_implementation!r}: "
            "load it with sdpa (model.attn_implementation) or set strategy.context_parallel=1"
        )
    if problems:
        raise UserError("; ".join(problems))
    name = f"{NAME}_{next(_names)}"

    def attention(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _attention(group, module, query, *args, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None)  # causal, no padding mask
    text = getattr(config, "get_text_config", lambda: config)()
    for c in {id(config): config, id(text): text}.values():
        c._attn_implementation = name
    return name


def _attention(
    group: dist.ProcessGroup,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call on this rank's tokens: ``query`` ``(b, heads, s, d)``, ``key`` /
    ``value`` ``(b, kv_heads, s, d)``; returns ``(b, s, heads, d)``. ``cu_seq_lens_q`` among ``kwargs``
    are the bounds of a packed row over the whole sequence (every rank's slice)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from reroll.models.packed_attention import attention as packed_attention

    q, k, v = (sequence_to_heads(x, group) for x in (query, key, value))
    kwargs.pop("position_ids", None)  # this rank's slice's: the whole sequence's bounds come in cu_seq_lens
    if kwargs.get("cu_seq_lens_q") is not None:
        out, _ = packed_attention(module, q, k, v, None, scaling=scaling, dropout=dropout, **kwargs)
    else:
        out, _ = sdpa_attention_forward(module, q, k, v, None, scaling=scaling, dropout=dropout, **kwargs)
    return heads_to_sequence(out, group), None
