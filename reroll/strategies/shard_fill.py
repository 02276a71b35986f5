"""A sharded model's weights read by each rank from the checkpoint's files, its own rows alone.

FSDP2 builds the model on the meta device (``reroll.models.loading.empty_model``: parameters take no
memory, buffers are computed on the host), changes it as it would a loaded one, shards it, then
``fill`` gives each rank's ``Shard(0)`` chunk of every parameter the rows the checkpoint has there,
read from its safetensors files (``CheckpointReader.narrow``). A rank so reads and holds about
``1 / world_size`` of the model on the host instead of the whole of it.

``plan`` says where each parameter comes from, from the files' headers alone, by transformers' own
conversion rules for the model (``get_model_conversion_mapping``, applied to each checkpoint name as
``from_pretrained`` applies them: ``rename_source_key``): a renamed tensor (a vision-language model's
``visual.*`` and ``model.*``, held as ``model.visual.*`` and ``model.language_model.*``) is read by rows
under its name in the files; fused experts (``mlp.experts.gate_up_proj`` ``(E, 2I, H)``, ``down_proj``
``(E, H, I)``) from the per-expert tensors ``save_pretrained`` writes, as ``reroll.models.expert_fusion``
reads the fusion (one expert a row of dim 0, so a rank reads its experts whole); a parameter the
checkpoint lacks (a new scoring head) zeros where the loader starts it at zero. A conversion the plan
does not follow (a transpose, a split), or a tensor of another shape or dtype, is not planned: the caller
loads the whole model as before and says why. A parameter already on the host when the model is sharded
(a LoRA adapter, initialised as peft initialises it) keeps its values.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from reroll.models.checkpoint_reader import CheckpointReader
from reroll.models.expert_fusion import row_sources


@dataclass(frozen=True)
class Source:
    """A parameter's checkpoint tensors: ``rows`` ``[(name, ...), ...]``, one entry per row block of dim 0
    concatenated in order; with ``whole_rows`` each entry is one row of the parameter (an expert: its
    tensors read whole, concatenated on their dim 0, stacked), else there is one entry, one tensor read by
    rows (``narrow``). No rows: zeros."""

    rows: tuple[tuple[str, ...], ...]
    whole_rows: bool = False


@dataclass(frozen=True)
class Target:
    """Parameter ``attr`` of ``module`` (the module object survives LoRA wrapping and sharding, its name
    does not) and where its values come from."""

    module: torch.nn.Module
    attr: str
    name: str
    source: Source


def plan(
    model: torch.nn.Module, reader: CheckpointReader, *, zero_missing: bool
) -> tuple[list[Target], list[str]]:
    """Where each of ``model``'s meta parameters (a tied one once) comes from, and the names (or
    conversions, described) that no rule places: empty, the plan is whole. Reads the files' headers only;
    leaves on ``model`` the conversions it followed, as ``from_pretrained`` leaves them
    (``_weight_conversions``: what saving the model reverts)."""
    sources, unplaced = checkpoint_sources(model, list(reader))
    targets: list[Target] = []
    params = dict(model.named_parameters(remove_duplicate=False))
    # a persistent buffer the checkpoint holds would be read by from_pretrained: not planned (none in
    # the models reroll trains; their rotary frequencies are non-persistent, computed on build)
    unplaced += [n for n in model.state_dict(keep_vars=True) if n not in params and n in sources]
    for name, param in model.named_parameters():
        if not param.is_meta:
            continue
        source = sources.get(name, Source(()) if zero_missing else None)
        if (
            source is None
            or param.dtype != reader.dtype  # (a module kept in float32: read as loaded)
            or _shape(source, reader) not in (None, tuple(param.shape))
        ):
            unplaced.append(name)
            continue
        module_name, _, attr = name.rpartition(".")
        targets.append(Target(model.get_submodule(module_name), attr, name, source))
    return targets, unplaced


def checkpoint_sources(model: torch.nn.Module, names: list[str]) -> tuple[dict[str, Source], list[str]]:
    """``{name in model: Source}`` for the checkpoint tensors ``names``, each renamed (and experts fused)
    by transformers' conversion rules for ``model`` as ``from_pretrained`` renames them; and each
    conversion that touches ``names`` and that a ``Source`` cannot follow, described (where there are any,
    ``from_pretrained`` would hold something other than what the sources say)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # transformers 4: a class's renames alone, not followed
        renames = getattr(model, "_checkpoint_conversion_mapping", None) or {}
        touched = [f"{k} -> {v}" for k, v in renames.items() if any(re.search(k, n) for n in names)]
        return {n: Source(((n,),)) for n in names}, touched
    rules = get_model_conversion_mapping(model)
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    own = model.state_dict()
    prefix = model.base_model_prefix
    grouped: dict[str, dict[str | None, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name in sorted(names, key=dot_natural_key):  # from_pretrained's order: experts stack by index
        target, pattern = rename_source_key(name, renamings, converters, prefix, own)
        if target not in own and name in own:  # as from_pretrained: the name itself, with the prefix fixed
            target, pattern = rename_source_key(name, [], [], base_model_prefix=prefix, meta_state_dict=own)
        grouped[target][pattern].append(name)
    model._weight_conversions = [r for r in rules if r.was_used()]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    sources, unfollowed = {}, []
    for target, by_source in grouped.items():
        source = _followed(by_source, by_pattern)
        if source is not None:
            sources[target] = source
        elif None in by_source:
            unfollowed.append(f"{', '.join(by_source[None])} all renamed to {target}")
        else:
            c = by_pattern[next(iter(by_source))]
            unfollowed.append(f"transformers converts {c.source_patterns} to {c.target_patterns} on load")
    return sources, unfollowed


def _followed(by_source: dict[str | None, list[str]], by_pattern: dict[str, Any]) -> Source | None:
    """The ``Source`` of one parameter from its checkpoint tensors grouped by the conversion's source
    pattern that took them (None: a rename alone), where a ``Source`` describes the conversion."""
    if None in by_source:
        return Source(((by_source[None][0],),)) if len(by_source) == len(by_source[None]) == 1 else None
    patterns = row_sources(by_pattern[next(iter(by_source))])
    if patterns is None or set(by_source) != set(patterns):
        return None
    per_pattern = [by_source[p] for p in patterns]
    if len({len(names) for names in per_pattern}) != 1:
        return None
    return Source(tuple(zip(*per_pattern)), whole_rows=True)


def _shape(source: Source, reader: CheckpointReader) -> tuple[int, ...] | None:
    """The parameter shape ``source`` gives (None for zeros: any); ``(-1,)``, no shape, where its rows
    disagree."""
    if not source.rows:
        return None
    if not source.whole_rows:
        return reader.shape(source.rows[0][0])
    rows = {_row_shape(reader, r) for r in source.rows}
    return (len(source.rows), *rows.pop()) if len(rows) == 1 and () not in rows else (-1,)


def _row_shape(reader: CheckpointReader, names: tuple[str, ...]) -> tuple[int, ...]:
    """The shape of ``names``' tensors concatenated on dim 0; ``()`` where they cannot be."""
    shapes = [reader.shape(n) for n in names]
    if any(len(s) < 1 or s[1:] != shapes[0][1:] for s in shapes):
        return ()
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def write_rows(reader: CheckpointReader, source: Source, start: int, local: torch.Tensor) -> None:
    """Write rows ``[start, start + len(local))`` of dim 0 of the parameter ``source`` describes into
    ``local`` (this rank's shard), one checkpoint tensor at a time: no copy of the shard is made."""
    if not source.rows:
        local.zero_()
    elif source.whole_rows:
        for row, names in zip(local, source.rows[start : start + local.shape[0]]):
            at = 0
            for name in names:
                part = reader[name]
                row[at : at + part.shape[0]].copy_(part)
                at += part.shape[0]
    elif local.shape[0]:
        (name,) = source.rows[0]
        local.copy_(reader.narrow(name, 0, start, local.shape[0]))


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """``(start, length)``: the rows of dim 0 this rank's shard of ``param`` holds (all of a plain tensor)."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise RuntimeError(f"a shard of {tuple(param.shape)} cut on other dims than 0: {param.placements}")
    return offset[0], shape[0]


def fill(
    model: torch.nn.Module, targets: list[Target], reader: CheckpointReader, device: torch.device
) -> None:
    """Materialise ``model`` (sharded, its planned parameters on the meta device) on ``device`` and fill
    each rank's shard of every planned parameter from ``reader``; the parameters that were already real
    keep their values, and the buffers their tensors where ``fully_shard`` put them (``to_empty`` gives
    every tensor new memory on ``device``)."""
    modules = list(model.modules())
    kept = {
        (i, attr): _local(p)  # the old memory: to_empty swaps in new
        for i, m in enumerate(modules)
        for attr, p in m._parameters.items()
        if p is not None and not _local(p).is_meta
    }
    buffers = [dict(m._buffers) for m in modules]
    model.to_empty(device=device)
    with torch.no_grad():
        for i, m in enumerate(modules):
            for attr, p in m._parameters.items():
                if (i, attr) in kept:
                    _local(p).copy_(kept[(i, attr)])
            m._buffers.update(buffers[i])
        for t in targets:
            param = getattr(t.module, t.attr)
            local = _local(param)
            start, length = local_rows(param)
            if length != local.shape[0]:
                raise RuntimeError(
                    f"{t.name}: the shard holds {local.shape[0]} rows, its placement says {length}"
                )
            write_rows(reader, t.source, start, local)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


@contextlib.contextmanager
def adapters_on_host() -> Iterator[None]:
    """Inside the block, moving a module to the meta device leaves its tensors where they are (a dtype in
    the same call still applies): peft moves a new adapter (initialised on the host) to its base layer's
    device, and on the meta device its fresh values would be lost. The base layers are on the meta device
    already."""
    to = torch.nn.Module.to

    def not_to_meta(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or device.type != "meta":
            return to(self, *args, **kwargs)
        return self if dtype is None else to(self, dtype=dtype, non_blocking=non_blocking)

    torch.nn.Module.to = not_to_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.to = to  # type: ignore[method-assign]


def meta_parameters(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """``model``'s parameters still on the meta device."""
    return {n: p for n, p in model.named_parameters() if _local(p).is_meta}
