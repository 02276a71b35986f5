"""A checkpoint's ``model/``: a Hugging Face model directory written from a sharded model by every rank,
one unit of whole tensors at a time, so no rank ever holds the whole model.

A unit is a decoder layer (the blocks FSDP2 shards by), or a module outside them (the embeddings, the
final norm, the head). Units are gathered whole in turn (a collective where the model is sharded), turned into what
``save_pretrained`` would save (``HFNames``: tied copies dropped, LoRA adapters merged, transformers'
own weight conversions reverted, such as an MoE layer's fused experts split back into one tensor per
expert), and written into one of the directory's safetensors files by the rank that owns that file,
on a thread, while the next unit is gathered. A rank holds at most two units' full tensors (one
being written, one gathered) beside its own shard. The files (as many as ranks, more where one would
pass ``MAX_FILE_BYTES``) are owned round-robin, so every rank writes; rank 0 also writes
``config.json``, ``generation_config.json`` and the index. ``from_pretrained`` loads the directory.
A strategy whose weights come as a stream of whole tensors that every rank reads alike (Megatron's,
gathered layer by layer over its parallel groups) gathers through ``StreamGather``.

Each file's header is known before any tensor is gathered: the same conversion runs first on meta
tensors (shapes and dtypes only), so each tensor's bytes go straight to their offset.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from reroll.strategies.lora import merged_state_dict

MAX_FILE_BYTES = 5 * 2**30  # transformers' former default shard size
INDEX = "model.safetensors.index.json"
_ADAPTER_PART = re.compile(r"\.(base_layer|lora_[AB]\.[^.]+)$")

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

# (the unit's state-dict names, keep) -> those tensors whole on CPU where keep, else {}; every rank calls
# it for every unit in the same order (a sharded strategy all-gathers inside)
Gather = Callable[[Sequence[str], bool], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class HFNames:
    """How a strategy's state-dict tensors become the ones ``save_pretrained`` writes: ``model`` (the
    Hugging Face model, inside any peft wrapper: its config and weight conversions), the LoRA scale
    (alpha / r) where adapters are merged, else None."""

    model: Any
    lora_scale: float | None = None

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.lora_scale is not None:
            tensors = merged_state_dict(tensors, scale=self.lora_scale)
        return _revert_conversions(self.model, tensors)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (its ``_no_split_modules`` classes), in order: FSDP2's
    units, and the units a model is exported by (FSDP2 renames a sharded block's class ``FSDP<name>``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in names]


def distinct_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict (parameters as they are, sharded or not) without the later names of a
    tensor registered twice (tied embeddings: ``save_pretrained`` drops them too)."""
    seen: set[int] = set()
    out = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            out[name] = value
    return out


def layer_units(
    module: torch.nn.Module, names: Iterable[str], layers: Sequence[torch.nn.Module]
) -> list[list[str]]:
    """``names`` (of ``module``'s state dict) in the units they are exported by: one per decoder layer in
    ``layers``, and one per module outside them (the embeddings, the final norm, the head: each alone,
    the largest of them being what bounds the export's memory), a LoRA-wrapped one with its adapters."""
    prefixes = {id(m): f"{n}." for n, m in module.named_modules()}
    layer_prefixes = [prefixes[id(layer)] for layer in layers]
    units: dict[str, list[str]] = {}
    for name in names:
        owner = next((p for p in layer_prefixes if name.startswith(p)), None)
        if owner is None:  # the module holding it, above peft's base_layer / lora_A.default
            owner = _ADAPTER_PART.sub("", name.rpartition(".")[0])
        units.setdefault(owner, []).append(name)
    return list(units.values())


def full_weights(
    model: torch.nn.Module,
    hf_model: torch.nn.Module,
    lora_scale: float | None,
    whole: Callable[[torch.Tensor], torch.Tensor],
    *,
    on_device: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s weights (``hf_model``: the Hugging Face model inside any peft wrapper) one at a time
    in Hugging Face names, each made whole (``whole``: detached, or an FSDP2 all-gather, a collective
    every rank joins in the same order): on their device (``on_device``) or as CPU copies. With LoRA
    (``lora_scale``: alpha / r) a unit at a time (``layer_units``: a decoder layer, or a module outside
    them), its adapters merged into their base weights where the tensors are (``merged_state_dict``),
    so the merged model is never whole in memory and never merged on the host when it sits on a GPU."""
    state = model.state_dict()
    if lora_scale is None:
        named: Iterable[tuple[str, torch.Tensor]] = ((k, whole(v)) for k, v in state.items())
    else:
        units = layer_units(model, state, decoder_layers(hf_model))
        named = (
            item
            for unit in units
            for item in merged_state_dict({n: whole(state[n]) for n in unit}, scale=lora_scale).items()
        )
    for name, value in named:
        yield name, value if on_device else value.to("cpu", copy=True)


def write_hf_model(
    directory: Path,
    names: HFNames,
    shapes: Mapping[str, torch.Tensor],
    units: Sequence[Sequence[str]],
    gather: Gather,
    *,
    rank: int,
    world_size: int,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> int:
    """Write ``directory`` as ``save_pretrained`` would (see the module docstring); every rank calls it.

    ``shapes``: each state-dict name's global shape and dtype (meta tensors will do); ``units``: the
    names gathered together, in the order every rank gathers them. Returns the most bytes of whole
    tensors this rank held at once (the unit being written and the one gathered beside it)."""
    directory.mkdir(parents=True, exist_ok=True)
    plan = _plan(names, shapes, units, world_size, max_file_bytes)
    if rank == 0:
        _write_config(directory, names.model)
        if len(plan.files) > 1:
            weight_map = {
                n: plan.files[f].name for f, unit in zip(plan.unit_file, plan.outputs) for n in unit
            }
            index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
            (directory / INDEX).write_text(json.dumps(index, indent=2))
    mine = [i for i, _ in enumerate(plan.files) if i % world_size == rank]
    with ExitStack() as stack, ThreadPoolExecutor(1) as writer:
        handles = {i: stack.enter_context(plan.files[i].open(directory)) for i in mine}
        pending: Future[None] | None = None
        writing = peak = 0  # bytes of the unit being written
        for unit, file, expected in zip(units, plan.unit_file, plan.outputs):
            keep = file in handles
            tensors = gather(unit, keep)
            if not keep:
                continue
            out = names(tensors)
            _check_same(out, expected)
            held = sum(_nbytes(t) for t in out.values())
            peak = max(peak, writing + held)
            if pending is not None:
                pending.result()  # one write in flight at a time: at most two units held
            pending, writing = writer.submit(_write_tensors, handles[file], out.values()), held
        if pending is not None:
            pending.result()
    return peak


class StreamGather:
    """A ``Gather`` over ``stream``: ``(name, whole CPU tensor)`` pairs that every rank reads to the end in
    the same order (a collective: Megatron's weights, gathered one decoder layer at a time). Each call
    reads on until the unit's names have come, and hands them over where ``keep``; names no unit asks
    for (a tied head's copy of the embedding, which ``save_pretrained`` drops) are read and dropped.
    With units in the stream's order it holds at most one unit's tensors; ``peak_bytes`` says how many
    it held. ``finish`` reads the stream to its end (every rank must, for the collectives in it)."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]], units: Sequence[Sequence[str]]) -> None:
        self._stream = iter(stream)
        self._wanted = {n for unit in units for n in unit}
        self._early: dict[str, torch.Tensor] = {}
        self._held = self.peak_bytes = 0

    def __call__(self, names: Sequence[str], keep: bool) -> dict[str, torch.Tensor]:
        while not all(n in self._early for n in names):
            name, tensor = next(self._stream, (None, None))
            if name is None:
                missing = [n for n in names if n not in self._early]
                raise RuntimeError(f"the weights' stream ended without {missing[:5]}")
            if name in self._wanted:
                self._early[name] = tensor
                self._held += _nbytes(tensor)
                self.peak_bytes = max(self.peak_bytes, self._held)
        out = {n: self._early.pop(n) for n in names}
        self._held -= sum(_nbytes(t) for t in out.values())
        return out if keep else {}

    def finish(self) -> None:
        for _ in self._stream:
            pass


@dataclass
class _File:
    name: str
    header: dict[str, Any]

    def open(self, directory: Path) -> IO[bytes]:
        """The file, created with its header written; tensors are appended in header order."""
        handle = (directory / self.name).open("wb")
        header = json.dumps(self.header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        handle.write(struct.pack("<Q", len(header)) + header)
        return handle


@dataclass
class _Plan:
    files: list[_File]
    unit_file: list[int]  # the file each unit goes into
    outputs: list[dict[str, torch.Tensor]]  # each unit's tensors as saved (meta)
    total_bytes: int


def _plan(
    names: HFNames,
    shapes: Mapping[str, torch.Tensor],
    units: Sequence[Sequence[str]],
    world_size: int,
    max_file_bytes: int,
) -> _Plan:
    """Which file each unit goes into (the lightest so far: balanced, deterministic) and every file's
    header, from the conversion run on meta tensors."""
    outputs = [names({n: _meta(shapes[n]) for n in unit}) for unit in units]
    sizes = [sum(_nbytes(t) for t in out.values()) for out in outputs]
    total = sum(sizes)
    count = max(1, min(len(units), max(world_size, math.ceil(total / max_file_bytes))))
    loads, members = [0] * count, [[] for _ in range(count)]
    unit_file = []
    for u, size in enumerate(sizes):
        f = loads.index(min(loads))
        loads[f] += size
        members[f].append(u)
        unit_file.append(f)
    files = []
    for f in range(count):
        name = "model.safetensors" if count == 1 else f"model-{f + 1:05d}-of-{count:05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for u in members[f]:
            for key, t in outputs[u].items():
                size = _nbytes(t)
                header[key] = {
                    "dtype": _DTYPES[t.dtype],
                    "shape": list(t.shape),
                    "data_offsets": [offset, offset + size],
                }
                offset += size
        files.append(_File(name, header))
    return _Plan(files, unit_file, outputs, total)


def _write_tensors(handle: IO[bytes], tensors: Iterable[torch.Tensor]) -> None:
    for t in tensors:
        handle.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def _check_same(out: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    got = [(k, tuple(v.shape), v.dtype) for k, v in out.items()]
    planned = [(k, tuple(v.shape), v.dtype) for k, v in expected.items()]
    if got != planned:
        raise RuntimeError(f"the unit's tensors {got} differ from the ones planned from its shapes {planned}")


def _write_config(directory: Path, model: Any) -> None:
    """``config.json`` (with the model class as its architecture, as ``save_pretrained`` sets it) and,
    for a model that generates, ``generation_config.json``."""
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.config.save_pretrained(str(directory))
    if model.can_generate():
        model.generation_config.save_pretrained(str(directory))


def _revert_conversions(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors in the checkpoint's own format: transformers (5 on) converts some models' weights
    when it loads them (an MoE layer's experts fused into one tensor) and reverts that when it saves."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: no conversions
        return tensors
    return revert_weight_conversion(model, tensors)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
