"""Attention for packed rows that costs each row its own length squared, not the packed row's.

With ``optim.packing`` a micro-batch's rows run end to end as one ``(1, L)`` sequence whose
``position_ids`` restart at each row. transformers' ``sdpa`` attention serves that by building a
block-diagonal ``(L, L)`` mask and attending over all of it: 16 rows of 384 tokens cost 16 times the
attention of the padded rows. ``attend_rows_apart(model)`` switches a model to the implementation
registered here, which

- on a packed call (``cu_seq_lens_q`` / ``max_length_q`` among the forward's keyword arguments, as
  ``packed_kwargs`` gives them; without them, read from ``position_ids`` at every layer): builds no
  mask and runs each row's causal attention alone: on CUDA in half precision, one call of torch's
  variable-length flash-attention kernel (``torch.nn.attention.varlen``); elsewhere
  ``scaled_dot_product_attention`` row by row;
- on any other call: is transformers' ``sdpa`` itself (its mask, its kernel), so padded rows, generation
  and a model shared with other code behave as before.

The sequence boundaries travel in the forward's keyword arguments, which transformers hands down to
every attention call, also when activation checkpointing recomputes a layer in the backward pass.
Models with sliding-window or soft-capped attention keep ``sdpa``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any

import torch

from reroll.data.transfer import to_device

NAME = "reroll_packed"
HALF = (torch.float16, torch.bfloat16)  # what the varlen flash kernel takes


def attend_rows_apart(model: torch.nn.Module) -> bool:
    """Switch ``model`` (a transformers model, or one wrapping it) from ``sdpa`` to this module's
    attention. Returns whether it did: models on another attention implementation, or with sliding
    windows or soft-capping in their config, are left as they are (packing then runs on ``sdpa``'s
    block-diagonal mask)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    text = getattr(config, "get_text_config", lambda: config)()
    windowed = getattr(text, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(text, "layer_types", None) or ()
    )
    if windowed or getattr(text, "attn_logit_softcapping", None) is not None:
        return False
    _register()
    for c in {id(config): config, id(text): text}.values():
        c._attn_implementation = NAME
    return True


def wants_packing(packing: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """``optim.packing`` resolved for a model computing in ``dtype`` on ``device``: as set, or (None)
    where the varlen kernel runs: in half precision on CUDA with torch's ``varlen_attn`` (an fp32 model
    would attend row by row, one kernel per row and layer)."""
    if packing is not None:
        return packing
    return device.type == "cuda" and dtype in HALF and _varlen() is not None


def packed_kwargs(position_ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The forward's keyword arguments that mark a packed ``(1, L)`` row: the rows' start offsets
    (flash-attention's ``cu_seqlens``, where ``position_ids`` restart at 0) and the longest row. Read
    on the host (the trainer packs there: no wait for the GPU) and the offsets' copy queued."""
    pos = position_ids.reshape(-1).cpu()
    starts = (pos == 0).nonzero().reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError(
            "packed_kwargs: position_ids of a packed row must start at 0 and restart at 0 per row"
        )
    cu = torch.cat([starts, torch.tensor([pos.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    cu = to_device(cu, device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def uses_packed_attention(model: Any) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _mask)
    _skip_packed_search()


def _skip_packed_search() -> None:
    """Where a model attends with this module and is given no attention mask, transformers' mask
    preparation is handed no ``position_ids``: it would search them for packed rows
    (``find_packed_sequence_indices``), whose ``.all()`` in a Python ``if`` makes the host wait for the
    GPU at every forward, for a mask ``_mask`` does not build (with no attention mask it returns none,
    packed rows or not: ``attention`` keeps them apart). Nothing else there reads the positions. Left
    as it is where this transformers has no such function or its parameters are named otherwise."""
    from transformers import masking_utils

    prepare = getattr(masking_utils, "_preprocess_mask_arguments", None)
    if prepare is None or getattr(prepare, "skips_packed_search", False):
        return
    signature = inspect.signature(prepare)
    if not {"config", "attention_mask", "position_ids"} <= set(signature.parameters):
        return

    @functools.wraps(prepare)
    def without_positions(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        if (
            given.get("attention_mask") is None
            and getattr(given["config"], "_attn_implementation", None) == NAME
        ):
            given["position_ids"] = None
        return prepare(*bound.args, **bound.kwargs)

    without_positions.skips_packed_search = True  # type: ignore[attr-defined]
    masking_utils._preprocess_mask_arguments = without_positions


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """``sdpa``'s mask, except for a call without one (a packed row, or rows with no padding): none,
    and ``attention`` attends causally (within each row, for a packed call)."""
    from transformers.masking_utils import sdpa_mask

    return None if kwargs.get("attention_mask") is None else sdpa_mask(*args, **kwargs)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call: ``query`` ``(b, heads, t, d)``, ``key`` / ``value`` ``(b, kv_heads,
    t, d)``; returns ``(b, t, heads, d)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pos = kwargs.get("position_ids")
    if kwargs.get("cu_seq_lens_q") is None and attention_mask is None and _restarts(pos, query.shape[0]):
        kwargs.update(packed_kwargs(pos, query.device))  # a packed row passed without its bounds
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or attention_mask is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention: expected one packed row, got a batch of {query.shape[0]}")
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(f"packed attention: {name} is not supported; this model should use sdpa")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (L, heads, d)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if _flash_can(q) and dropout == 0.0:
        out = _flash_rows(q, k, v, cu, int(kwargs["max_length_q"]), scale)
    else:
        out = _rows_one_by_one(q, k, v, cu, scale, dropout)
    return out[None], None


def _flash_can(q: torch.Tensor) -> bool:
    """Whether torch's flash kernel takes these queries: CUDA, half precision, head size a multiple of 8
    up to 256 (an fp32 model goes row by row through sdpa)."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in HALF and d % 8 == 0 and d <= 256 and _varlen() is not None


def _restarts(position_ids: torch.Tensor | None, batch: int) -> bool:
    """Whether ``position_ids`` are one packed row's: they restart at 0 after its first token."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] < 2:
        return False
    return bool((position_ids.reshape(-1)[1:] == 0).any())


def _flash_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float
) -> torch.Tensor:
    """Every row's causal attention in one call of torch's varlen kernel; ``(L, heads, d)``."""
    fn, params = _varlen()
    options: dict[str, Any] = {}
    if "window_size" in params:  # torch >= 2.10: causal is the window (-1, 0)
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if "scale" in params:
        options["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return _rows_one_by_one(q, k, v, cu, scale, 0.0)
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return fn(q, k, v, cu, cu, longest, longest, **options)


def _rows_one_by_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, dropout: float
) -> torch.Tensor:
    """Each row's causal attention by ``scaled_dot_product_attention`` alone (no kernel for packed rows
    here: CPU, or torch without ``varlen``); ``(L, heads, d)``."""
    bounds = cu.tolist()
    gqa = k.shape[1] != q.shape[1]
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)),
            is_causal=True,
            scale=scale,
            dropout_p=dropout,
            enable_gqa=gqa,
        ).transpose(0, 1)
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(parts)


@functools.cache
def _varlen() -> tuple[Any, frozenset[str]] | None:
    """torch's ``varlen_attn`` and the names of its parameters (they changed between releases), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)
