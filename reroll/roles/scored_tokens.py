"""The scored tokens' log-probs and entropy off a causal LM's head, computed at their positions alone.

``scored_token_stats`` runs a model's forward with its ``lm_head`` at the positions before the scored
(response) tokens: where the strategy and the model allow it (``Strategy.fused_head``, the torch and
FSDP2 strategies; ``fused_head_problem``) the head computes their log-probs and entropy from its input
and weight itself (``fused_head_at``: no ``(tokens, vocabulary)`` logits kept for backward), else it
makes those positions' logits (``head_at``), else the whole output is computed and those rows taken.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from reroll.algorithms.logprobs import linear_logprobs_and_entropy, selected_logprobs_and_entropy
from reroll.data.transfer import to_device
from reroll.strategies.context_parallel import ContextParallel

log = logging.getLogger(__name__)


def _lm_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.split(".")[-1] == "lm_head"]


def _compiled(model: torch.nn.Module) -> bool:
    return getattr(model, "_compiled_call_impl", None) is not None


@contextlib.contextmanager
def head_at(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[bool]:
    """Inside the block, ``model``'s ``lm_head`` computes only the rows ``positions`` of its input
    flattened to ``(N, hidden)``: the forward's logits are ``(1, K, V)``. The rows are selected by a
    pre-hook on the head (inside the forward, where a sharded head is gathered), so hidden states of
    the other positions never meet the vocabulary. Yields False, changing nothing, where there is not
    exactly one ``lm_head`` or the model is compiled (a hook that changes per call would recompile it)."""
    heads = _lm_heads(model)
    if len(heads) != 1 or _compiled(model):
        yield False
        return

    def select(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        rows = hidden.reshape(-1, hidden.shape[-1])[positions.to(hidden.device)]
        return (rows[None], *args[1:])

    handle = heads[0].register_forward_pre_hook(select)
    try:
        yield True
    finally:
        handle.remove()


# models whose forward was seen to change what their head returns (a logit soft-cap or scale): the
# fused head's output would be changed the same way, so they keep head_at's logits
_TRANSFORMS_HEAD = weakref.WeakSet[torch.nn.Module]()


def fused_head_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s head cannot compute the scored tokens' log-probs itself (``fused_head_at``), or
    None: it must be its one ``lm_head``, a plain ``torch.nn.Linear`` (tied to the embedding or not;
    not LoRA-wrapped, its forward not replaced by a hook), in a model that is not compiled and whose
    forward returns the head's output as its logits unchanged (learnt at the first call that finds
    otherwise: ``scored_token_stats``)."""
    heads = _lm_heads(model)
    if len(heads) != 1:
        return f"{type(model).__name__} has {len(heads)} modules named lm_head, not one"
    head = heads[0]
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return f"its lm_head is a {type(head).__name__}, not a plain torch.nn.Linear"
    if "forward" in vars(head):
        return "its lm_head's forward is replaced (a hook of another library)"
    if _compiled(model):
        return "the model is compiled (a head that changes per call would recompile it)"
    if model in _TRANSFORMS_HEAD:
        return f"{type(model).__name__}'s forward changes what its lm_head returns (a logit cap or scale)"
    return None


@dataclass
class FusedHead:
    """What the fused head returned in the last forward: ``logp`` ``(1, K)`` (the forward's "logits")
    and ``ent`` ``(K,)``, fp32."""

    logp: torch.Tensor | None = None
    ent: torch.Tensor | None = None


@contextlib.contextmanager
def fused_head_at(
    model: torch.nn.Module,
    positions: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    entropy: bool,
    chunk_tokens: int | None = None,
) -> Iterator[FusedHead | None]:
    """Inside the block, ``model``'s ``lm_head`` returns the log-probs of ``targets`` ``(K,)`` read off
    the rows ``positions`` of its input (as ``head_at`` selects them) and keeps their entropy (zeros
    unless ``entropy``) in the yielded ``FusedHead``, by ``linear_logprobs_and_entropy``: no ``(K, V)``
    logits are made. It computes this in place of its forward, inside its call, so that a sharded head
    (FSDP2) is gathered there as for its own forward, and its gradient taken when the log-probs get
    theirs (every loss reads them). Yields None, changing nothing, where ``fused_head_problem`` says why not."""
    if fused_head_problem(model) is not None:
        yield None
        return
    head = _lm_heads(model)[0]
    out = FusedHead()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])[positions.to(hidden.device)]
        logp, out.ent = linear_logprobs_and_entropy(
            rows, head.weight, head.bias, targets, temperature, entropy=entropy, chunk_tokens=chunk_tokens
        )
        out.logp = logp[None].clone()  # not a view: FSDP2 warns of hooks on a module's view outputs
        return out.logp

    head.forward = forward  # an instance attribute: the class's forward comes back when it is deleted
    try:
        yield out
    finally:
        del head.forward


def scored_token_stats(
    model: torch.nn.Module,
    forward: Callable[[], torch.Tensor],
    picked: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float,
    *,
    entropy: bool,
    chunk_tokens: int | None = None,
    split: tuple[ContextParallel, int] | None = None,
    fused: bool = False,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T)`` fp32 log-probs of the tokens at ``(rows, cols + 1)`` of ``input_ids`` and their entropy
    (zeros unless ``entropy``), 0 elsewhere: ``forward()`` runs ``model`` with its head at the flattened
    input positions ``picked`` alone (one per scored token, in the same order). ``chunk_tokens``: as
    ``token_logprobs``'s. ``split``: this rank's context-parallel group and the width of the model's
    input rows; ``forward()`` then runs this rank's columns, whose scored tokens it computes, and the
    group's are combined (``ContextParallel.combine``).

    Which path a model takes: with ``fused`` (a strategy whose head is a plain module inside the
    forward, ``Strategy.fused_head``: torch and FSDP2) and where ``fused_head_problem`` finds nothing, the
    head computes the log-probs and entropy from the hidden states itself (``fused_head_at``): no
    ``(K, V)`` logits are kept for backward. Else it computes the ``(K, V)`` logits of those positions
    (``head_at``), reduced by ``selected_logprobs_and_entropy``; where it cannot be restricted (no single
    ``lm_head``, a compiled model), the whole output is computed and those rows taken. A model whose
    forward turns out to change its head's output (a logit cap or scale: the fused values would be
    changed too) runs the micro-batch again on the logits path and keeps it from then on.

    ``device``: where the forward computes. The indices above, made on the host, are then copied there
    before the forward, the copies queued (``to_device``): nothing in the forward waits for the GPU."""
    targets, after = input_ids[rows, cols + 1], cols + 1  # position t-1 scores column t
    local = split[0].picks(picked, split[1]) if split is not None else None
    if local is not None:
        picked, targets = local.positions, targets[local.keep]
    if device is not None:
        picked, targets, rows, after = (to_device(t, device) for t in (picked, targets, rows, after))
    stats = None
    if fused:
        stats = _fused_stats(model, forward, picked, targets, temperature, entropy, chunk_tokens)
    if stats is None:
        stats = _logits_stats(model, forward, picked, targets, temperature, entropy, chunk_tokens)
    logp, ent = stats
    if local is not None:
        cp = split[0]
        logp, ent = cp.combine(logp, local), cp.combine(ent, local)
    dev = logp.device
    where = (rows.to(dev), after.to(dev))
    zeros = torch.zeros(input_ids.shape, dtype=torch.float32, device=dev)
    return zeros.index_put(where, logp), zeros.index_put(where, ent)


def _fused_stats(
    model: torch.nn.Module,
    forward: Callable[[], torch.Tensor],
    picked: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
    chunk_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(K,)`` log-probs and entropy from the fused head, or None where it cannot be used."""
    with fused_head_at(
        model, picked, targets, temperature, entropy=entropy, chunk_tokens=chunk_tokens
    ) as head:
        if head is None:
            return None
        out = forward()
    if out is head.logp:
        return out[0], head.ent
    _TRANSFORMS_HEAD.add(model)
    log.warning(
        "%s's forward changes what its lm_head returns: log-probs come from the head's logits "
        "(head_at), not from the fused head",
        type(model).__name__,
    )
    return None


def _logits_stats(
    model: torch.nn.Module,
    forward: Callable[[], torch.Tensor],
    picked: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool,
    chunk_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K,)`` log-probs and entropy read off the logits of the ``picked`` positions (``head_at``)."""
    with head_at(model, picked) as selected:
        logits = forward()
    logits = logits.reshape(-1, logits.shape[-1])
    if not selected:  # the full output: take the same rows of it
        logits = logits[picked.to(logits.device)]
    return selected_logprobs_and_entropy(
        logits, targets.to(logits.device), temperature, entropy=entropy, chunk_tokens=chunk_tokens
    )
