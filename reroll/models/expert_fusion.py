"""transformers' fusion of an MoE layer's experts on load: the one place reroll reads it.

transformers 5 holds a fused-experts MoE layer (Qwen3-MoE) as one tensor per projection,
``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` and ``mlp.experts.down_proj`` ``(E, H, I)``, built on load
from the per-expert tensors ``save_pretrained`` writes (``mlp.experts.{e}.gate_proj.weight``, ...) by a
``WeightConverter`` that stacks the experts on dim 0 (``MergeModulelist``) and, with several sources,
concatenates the stacks on dim 1 (``Concatenate``). Row ``e`` of the fused tensor is then expert ``e``'s
source tensors concatenated on their dim 0, in the converter's order: gate, then up.

``row_sources`` reads that from a converter (``reroll.strategies.shard_fill`` follows the model's own);
``expert_row`` names one expert's tensors (``reroll.models.megatron_convert``). transformers 4 fuses
nothing: its Qwen3-MoE modules are the checkpoint's per-expert tensors, and ``expert_row`` names those.
"""

from __future__ import annotations

import functools
from typing import Any

# transformers 4 (no conversion rules): {fused name: expert ``*``'s tensors}, as transformers 5 fuses them
_UNFUSED = {
    "mlp.experts.gate_up_proj": ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
    "mlp.experts.down_proj": ("mlp.experts.*.down_proj.weight",),
}


def row_sources(converter: Any) -> tuple[str, ...] | None:
    """The source patterns of transformers' weight ``converter`` (``*`` the expert's index) whose tensors
    for one expert, concatenated on dim 0 in this order, are that expert's row of dim 0 of the target:
    a converter that stacks experts (``MergeModulelist(dim=0)``) and, with several sources, concatenates
    the stacks on dim 1. None for any other conversion (a transpose, a split, ...)."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", ())]
    sources = tuple(converter.source_patterns)
    stacked = [("MergeModulelist", 0)]
    if (ops == stacked and len(sources) == 1) or ops == [*stacked, ("Concatenate", 1)]:
        return sources
    return None


def expert_row(model_type: str, fused: str, e: int) -> tuple[str, ...]:
    """The checkpoint tensors (``save_pretrained``'s names) whose dim-0 concatenation is expert ``e``'s row
    of the fused parameter ``fused`` (``model.layers.3.mlp.experts.gate_up_proj``) of a ``model_type``
    model, as transformers fuses them on load: ``(...experts.{e}.gate_proj.weight,
    ...experts.{e}.up_proj.weight)``. A ``KeyError`` for a name no rule of the model type makes."""
    for target, sources in _rows(model_type).items():
        if fused == target or fused.endswith("." + target):
            prefix = fused[: len(fused) - len(target)]
            return tuple(prefix + s.replace("*", str(e)) for s in sources)
    raise KeyError(f"{fused}: transformers fuses no experts into it for model type {model_type!r}")


@functools.cache
def _rows(model_type: str) -> dict[str, tuple[str, ...]]:
    """``{fused target pattern: row_sources}`` of ``model_type``'s expert-fusing converters."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4
        return dict(_UNFUSED)
    out = {}
    for converter in get_checkpoint_conversion_mapping(model_type) or ():
        sources = row_sources(converter)
        if sources is not None and len(converter.target_patterns) == 1:
            out[converter.target_patterns[0]] = sources
    return out
