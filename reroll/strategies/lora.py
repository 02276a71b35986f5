"""LoRA on a training strategy's policy (peft): wrap, name, merge, and what weight sync sends.

The policy is wrapped with ``peft.get_peft_model`` before any sharding, so only the adapters
``lora_A``/``lora_B`` train. peft renames the model's parameters (``base_model.model.<hf name>``, a
targeted layer's weight under ``.base_layer``); ``merged_state_dict`` turns such a state dict back into the
base model's Hugging Face names with W + (alpha / r) * B @ A folded in, so any engine can load it.
``AdapterUpdate`` is what an adapters-only sync sends instead: the adapter tensors in peft's saved
names and the ``LoraConfig`` as a dict.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from reroll.config.training import LoRAConfig

PREFIX = "base_model.model."  # peft's prefix before the wrapped model's own names
ADAPTER = "default"  # the one adapter reroll trains
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")


@dataclass
class AdapterUpdate:
    """An adapters-only weight sync: peft-named adapter tensors (``get_peft_model_state_dict``) and
    the ``peft.LoraConfig`` they belong to, as a dict (``LoraConfig(**config)`` rebuilds it)."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return payload_bytes(self.tensors)


def payload_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data in a weight-sync payload (what crosses to the engine)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def peft_config(lora: LoRAConfig) -> Any:
    """The ``peft.LoraConfig`` for ``lora`` (adapters in the base model's dtype, so FSDP2 units stay
    one dtype)."""
    from peft import LoraConfig

    return LoraConfig(**lora_config_dict(lora))


def lora_config_dict(lora: LoRAConfig) -> dict[str, Any]:
    """``lora`` as the keyword arguments of ``peft.LoraConfig`` (what an adapters-only sync carries)."""
    return {
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
    }


def apply_lora(
    model: PreTrainedModel, lora: LoRAConfig, *, trainable: bool, full: Sequence[str] = ()
) -> PeftModel:
    """``model`` wrapped with fresh adapters (B = 0, so it computes what ``model`` did); only they
    train, and the modules named in ``full`` (e.g. a reward model's new ``score`` head), every weight.

    An unknown module name in ``target_modules`` is a ``ValueError`` naming the linear layers there are.
    """
    from peft import get_peft_model

    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    unknown = [t for t in lora.target_modules if t not in linear]
    if unknown:
        raise ValueError(
            f"strategy.lora.target_modules: the model has no linear layer named {unknown}; "
            f"its linear layers are {linear}"
        )
    wrapped = get_peft_model(model, peft_config(lora), autocast_adapter_dtype=False)
    wrapped.train(trainable)
    for name, p in wrapped.named_parameters():
        p.requires_grad_(trainable and (".lora_" in name or is_full_key(name, full)))
    return wrapped


def is_adapter_key(name: str) -> bool:
    return _LORA_KEY.match(name) is not None


def is_full_key(name: str, full: Sequence[str]) -> bool:
    """Whether ``name`` (peft's or the model's) is a weight of a module in ``full``, trained in full."""
    name = name.removeprefix(PREFIX)
    return any(name.startswith(f"{m}.") for m in full)


def trained_key(name: str, full: Sequence[str]) -> bool:
    """Whether ``name`` is a tensor a LoRA run trains: an adapter's, or one of a module in ``full``."""
    return is_adapter_key(name) or is_full_key(name, full)


def full_modules(head: str) -> tuple[str, ...]:
    """The modules trained in full beside the adapters: a reward model's ``score`` head (new at zero, it
    must learn everything), none for a causal LM."""
    return ("score",) if head == "reward" else ()


def merged_weight(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W0 + scale * B @ A``, the one LoRA merge (A: ``(r, in)``, B: ``(out, r)``, ``scale = alpha / r``):
    computed in float32 on ``W0``'s device and cast back to its dtype. A shape that does not match is a
    ``ValueError`` naming both."""
    delta = scale * (b.to(w0.device, torch.float32) @ a.to(w0.device, torch.float32))
    if delta.shape != w0.shape:
        raise ValueError(f"the LoRA update has shape {tuple(delta.shape)}, the weight {tuple(w0.shape)}")
    return (w0.float() + delta).to(w0.dtype)


def merged_state_dict(state: Mapping[str, torch.Tensor], *, scale: float) -> dict[str, torch.Tensor]:
    """A peft model's full state dict -> the base model's, in Hugging Face names, adapters merged
    (``merged_weight``) into every adapted ``nn.Linear``; every other tensor keeps its value under its
    name with peft's ``base_model.model.`` prefix and ``.base_layer`` removed.
    """
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        m = _LORA_KEY.match(name)
        if m is not None:
            adapters.setdefault(m["module"], {})[m["ab"]] = value
            continue
        out[name.removeprefix(PREFIX).replace(".base_layer.", ".")] = value
    for module, ab in adapters.items():
        if set(ab) != {"A", "B"}:
            raise KeyError(
                f"adapter of {module!r} has only lora_{''.join(ab)}; both lora_A and lora_B needed"
            )
        key = f"{module.removeprefix(PREFIX)}.weight"
        out[key] = merged_weight(out[key], ab["A"], ab["B"], scale)
    return out


def adapter_names_to_model(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's saved adapter names (``...q_proj.lora_A.weight``) -> the live model's
    (``...q_proj.lora_A.default.weight``), to load a saved adapter into the wrapped model."""
    out = {}
    for name, value in state.items():
        head, _, leaf = name.rpartition(".")
        out[f"{head}.{ADAPTER}.{leaf}" if re.search(r"\.lora_[AB]$", head) else name] = value
    return out


def adapter_names_to_saved(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``adapter_names_to_model``: drop the adapter name (what ``get_peft_model_state_dict``
    and ``save_pretrained`` write)."""
    return {name.replace(f".{ADAPTER}.weight", ".weight"): v for name, v in state.items()}


def save_adapter(directory: Path, update: AdapterUpdate) -> None:
    """peft's format in ``directory`` (``adapter_model.safetensors``, ``adapter_config.json``): what
    ``PeftModel.from_pretrained(base, directory)`` and ``load_adapter`` read."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(update.tensors, str(directory / "adapter_model.safetensors"))
    LoraConfig(**update.config).save_pretrained(str(directory))


def load_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """A saved adapter's tensors under the live (wrapped) model's names."""
    from safetensors.torch import load_file

    path = directory / "adapter_model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this checkpoint was not saved with strategy.lora set")
    return adapter_names_to_model(load_file(str(path)))
