"""A sharded model's weights read by each rank from the checkpoint's files, its own rows alone.

FSDP2 builds the model on the meta device (``reroll.models.loading.empty_model``: parameters take no
memory, buffers are computed on the host), changes it as it would a loaded one, shards it, then
``fill`` gives each rank's ``Shard(0)`` chunk of every parameter the rows the checkpoint has there,
read from its safetensors files (``CheckpointReader.narrow``). A rank so reads and holds about
``1 / world_size`` of the model on the host instead of the whole of it.

``plan`` says where each parameter comes from, from the files' headers alone: the tensor of its own name;
transformers' fused experts (``mlp.experts.gate_up_proj`` ``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``)
from the per-expert tensors ``save_pretrained`` writes (``mlp.experts.{e}.gate_proj.weight`` and
``up_proj`` concatenated on dim 0, ``down_proj``), as transformers' conversion on load fuses them (one
expert a row of dim 0, so a rank reads its experts whole); a parameter the checkpoint lacks (a new
scoring head) zeros where the loader starts it at zero. Anything else (another layout or naming) is
not planned: the caller loads the whole model as before. A parameter already on the host when the model
is sharded (a LoRA adapter, initialised as peft initialises it) keeps its values.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from reroll.models.checkpoint_reader import CheckpointReader

# transformers' per-expert fusion on load, which ``_source`` follows: (sources, targets, operations)
_FOLLOWED = {
    (
        ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
        ("mlp.experts.gate_up_proj",),
        ("MergeModulelist", "Concatenate"),
    ),
    (("mlp.experts.*.down_proj.weight",), ("mlp.experts.down_proj",), ("MergeModulelist",)),
}
_FUSED = re.compile(r"(?P<experts>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = {"gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "down_proj": ("down_proj.weight",)}


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
    """Where each of ``model``'s meta parameters (a tied one once) comes from, and the names that no
    rule places (empty: the plan is whole). Reads the files' headers only."""
    targets: list[Target] = []
    unplaced = conversions(model, list(reader))
    params = dict(model.named_parameters(remove_duplicate=False))
    # a persistent buffer the checkpoint holds would be read by from_pretrained: not planned (none in
    # the decoder models reroll trains; their rotary frequencies are non-persistent, computed on build)
    unplaced += [n for n in model.state_dict(keep_vars=True) if n not in params and n in reader]
    for name, param in model.named_parameters():
        if not param.is_meta:
            continue
        source = _source(name, tuple(param.shape), reader, zero_missing)
        if source is None or param.dtype != reader.dtype:  # (a module kept in float32: read as loaded)
            unplaced.append(name)
            continue
        module_name, _, attr = name.rpartition(".")
        targets.append(Target(model.get_submodule(module_name), attr, name, source))
    return targets, unplaced


def conversions(model: torch.nn.Module, names: list[str]) -> list[str]:
    """transformers' load-time conversions of ``model``'s weights (renames, fusions, transposes) that touch
    a checkpoint tensor of ``names`` and that ``plan`` does not follow, each described: where there are
    any, ``from_pretrained`` would hold something other than the tensors of the model's own names."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: a class's renames alone
        renames = getattr(model, "_checkpoint_conversion_mapping", None) or {}
        return [f"{k} -> {v}" for k, v in renames.items() if any(_touches(k, n) for n in names)]
    out = []
    for c in get_model_conversion_mapping(model):
        sources, targets = tuple(c.source_patterns), tuple(c.target_patterns)
        ops = tuple(type(o).__name__ for o in getattr(c, "operations", ()))
        if (sources, targets, ops) not in _FOLLOWED and any(_touches(p, n) for p in sources for n in names):
            out.append(f"transformers converts {sources} to {targets} on load")
    return out


def _touches(pattern: str, name: str) -> bool:
    """Whether a conversion's source ``pattern`` (a regular expression, ``*`` a module index) matches
    ``name``; a pattern that is not one is taken to match (not followed, so not planned)."""
    try:
        return re.search(pattern.replace("*", r"[^.]+"), name) is not None
    except re.error:
        return True


def _source(name: str, shape: tuple[int, ...], reader: CheckpointReader, zero_missing: bool) -> Source | None:
    if name in reader:
        return Source(((name,),)) if reader.shape(name) == shape else None
    fused = _FUSED.match(name)
    if fused and len(shape) == 3:
        rows = tuple(
            tuple(f"{fused['experts']}.{e}.{part}" for part in _PER_EXPERT[fused["kind"]])
            for e in range(shape[0])
        )
        if all(n in reader for row in rows for n in row) and all(
            _row_shape(reader, r) == shape[1:] for r in rows
        ):
            return Source(rows, whole_rows=True)
        return None
    return Source(()) if zero_missing else None


def _row_shape(reader: CheckpointReader, names: tuple[str, ...]) -> tuple[int, ...]:
    shapes = [reader.shape(n) for n in names]
    if any(len(s) != 2 or s[1:] != shapes[0][1:] for s in shapes):
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
