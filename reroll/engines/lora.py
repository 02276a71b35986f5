"""LoRA adapters for the engines: peft's adapter tensors merged into the base weights they adapt.

The trainer (peft) sends only the adapter: ``{name: tensor}`` in peft's state-dict names
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, with or without the adapter name
before ``.weight``) and its ``LoraConfig`` as a dict (``r``, ``lora_alpha``, optionally ``use_rslora``).
The engine computes ``W = W0 + scale * B @ A`` (``scale = lora_alpha / r``, or ``/ sqrt(r)`` with
rsLoRA) for each adapted ``Linear`` and loads ``W`` like any weight update, so generation runs at
the base model's speed and every sync starts again from the frozen base ``W0``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from reroll.errors import UserError
from reroll.runtime.weight_sync import layer_key
from reroll.strategies.lora import merged_weight

_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


def lora_scale(config: Mapping[str, Any]) -> float:
    """``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``); unsupported options are an error."""
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise UserError(f"LoRA config has no {key!r}: pass peft's LoraConfig as a dict (r, lora_alpha)")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise UserError(f"LoRA config sets {key}=True, which the engines cannot merge; train without it")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise UserError(f"LoRA config sets {key}; per-module ranks are not supported by the engines")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def lora_pairs(adapter: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{base weight name: (A (r, in), B (out, r))}`` from peft's adapter state dict."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter.items():
        m = _PEFT_NAME.match(name)
        if m is None:
            raise UserError(
                f"LoRA adapter tensor {name!r} is not a peft lora_A/lora_B weight of a Linear layer "
                "(embedding adapters and modules_to_save are not supported)"
            )
        parts.setdefault(f"{m['module']}.weight", {})[m["part"]] = tensor
    missing = [k for k, v in parts.items() if len(v) != 2]
    if missing:
        raise UserError(f"LoRA adapter has lora_A without lora_B (or the reverse) for {missing[:3]}")
    return {k: (v["A"], v["B"]) for k, v in parts.items()}


def merge_lora(
    base: Mapping[str, torch.Tensor],
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> dict[str, torch.Tensor]:
    """``{name: W0 + scale * B @ A}`` for each adapted weight, in ``W0``'s dtype and device (targets and
    shapes checked first, ``_check_targets``)."""
    _check_targets(base, pairs)
    return {name: merged_weight(base[name], a, b, scale) for name, (a, b) in pairs.items()}


def layer_parts(
    base: Mapping[str, torch.Tensor],
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    names: Sequence[str],
) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
    """The tensors ``names`` of ``base`` a decoder layer (``layer_key``) at a time, each layer with the
    adapter pairs that reach it: what the vllm engine merges and loads per call (vLLM rebuilds a fused
    layer from one call's tensors). A target the checkpoint lacks is refused before any layer is given."""
    _check_targets(base, pairs)
    by_layer: dict[str, list[str]] = {}
    for name in names:
        by_layer.setdefault(layer_key(name), []).append(name)
    for layer in by_layer.values():
        yield {n: base[n] for n in layer}, {n: pairs[n] for n in layer if n in pairs}


def merged_layer(
    layer: Mapping[str, torch.Tensor],
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    device: torch.device,
) -> list[tuple[str, torch.Tensor]]:
    """One layer's tensors (``layer_parts``) on ``device``, each adapted weight merged there
    (``merge_lora``). On a GPU the merge is a matrix product per weight where the host's took about a
    second per 68M-element weight (a 7B model's LoRA sync took 58 s a step on an H100 machine's host,
    2026-12-07), and only one layer's tensors are on it at a time."""
    here = {n: t.to(device, non_blocking=True) for n, t in layer.items()}
    merged = merge_lora(here, pairs, scale)
    return [(n, merged.get(n, here[n])) for n in layer]


def _check_targets(base: Mapping[str, torch.Tensor], pairs: Mapping[str, Any]) -> None:
    """Every target in ``base``, and each update ``B @ A`` of its weight's shape: checked where the
    adapter arrives, before a worker in another process merges it (an error there would come back as
    that worker's failure)."""
    unknown = [name for name in pairs if name not in base]
    if unknown:
        raise UserError(f"LoRA adapter targets {unknown[0]!r}, which the model does not have")
    for name, (a, b) in pairs.items():
        shape, weight = (b.shape[0], a.shape[-1]), tuple(base[name].shape)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or shape != weight:
            raise UserError(
                f"LoRA update for {name!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not make an update "
                f"of the weight's shape {weight}"
            )


def checkpoint_names(model_path: str) -> list[str]:
    """The tensor names of a Hugging Face safetensors checkpoint directory (sharded or not)."""
    from safetensors import safe_open

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    with safe_open(str(root / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def checkpoint_tensors(model_path: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a Hugging Face safetensors checkpoint directory (sharded or not), on CPU."""
    from safetensors import safe_open

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    wanted = set(names)
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {weight_map[n] for n in wanted if n in weight_map}
    else:
        files = {"model.safetensors"}
    out = {}
    for file in sorted(files):
        with safe_open(str(root / file), framework="pt") as f:
            for name in wanted & set(f.keys()):
                out[name] = f.get_tensor(name)
    missing = wanted - set(out)
    if missing:
        raise UserError(
            f"the checkpoint at {model_path} has no tensors {sorted(missing)[:3]} for the LoRA base"
        )
    return out


def adapted_names(names: Iterable[str], target_modules: Sequence[str]) -> list[str]:
    """The weights of ``names`` that a peft ``LoraConfig`` with ``target_modules`` adapts: those of a
    module named one of them or ending in ``.`` and one (peft's rule for a list of names)."""
    out = []
    for name in names:
        module = name.removesuffix(".weight")
        if module != name and any(module == t or module.endswith(f".{t}") for t in target_modules):
            out.append(name)
    return out


class BaseWeights:
    """The base values a merged LoRA update starts from, read from the model's checkpoint (a LoRA run
    freezes the base, so the checkpoint's values are the base) once, and kept in host memory (pinned
    where the merge runs on a GPU, which copies them there at every sync).

    ``prefetch`` starts that read in a thread of its own when the engine starts, so that the first
    sync does not wait for it: a 7B model's first adapter sync read and pinned 15 GB in 14 s of a
    30 s step on an H100 machine (2026-12-07), the next ones took 1 s."""

    def __init__(self, model_path: str, *, pin: bool = False) -> None:
        self.model_path, self.pin = model_path, pin
        self.tensors: dict[str, torch.Tensor] = {}
        self._ahead: Future[dict[str, torch.Tensor]] | None = None

    def prefetch(self, names: Callable[[], Sequence[str]]) -> None:
        """Start reading the tensors ``names()`` lists, in the background (``take`` waits for it and
        raises what it raised)."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="lora-base")
        self._ahead = pool.submit(lambda: self._read(names()))
        pool.shutdown(wait=False)

    def take(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The base values of ``names``: what the prefetch read (waiting for it to end; what it read
        beyond ``names`` is dropped), the rest read now, and what earlier calls read."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead.result(), None
            wanted = set(names)
            self.tensors.update({k: v for k, v in ahead.items() if k in wanted})
        missing = [n for n in names if n not in self.tensors]
        if missing:
            self.tensors.update(self._read(missing))
        return self.tensors

    def _read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        fetched = checkpoint_tensors(self.model_path, names)
        return {k: v.pin_memory() if self.pin else v for k, v in fetched.items()}
