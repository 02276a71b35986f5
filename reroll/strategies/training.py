"""What the strategies that hold a Hugging Face model under a torch optimizer share: the warm-up
schedule, the forward pass over padded or packed rows, the finite-norm guarded step (a non-finite
gradient norm skips the update) and the LoRA reference switch. Parking the state in host memory while a
colocated role has the GPU: ``reroll.strategies.host_parking``."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from reroll.config.vision import PACKING_REFUSED
from reroll.data.transfer import to_device
from reroll.data.types import ImageInputs
from reroll.errors import UserError
from reroll.models.loading import position_ids_from
from reroll.models.packed_attention import packed_kwargs
from reroll.models.vision import freeze_vision, model_inputs
from reroll.strategies.memory import alloc_retries, peak_memory_gb

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

logger = logging.getLogger(__name__)


def compile_model(model: torch.nn.Module) -> int:
    """``torch.compile`` ``model``'s repeated blocks in place (``model.compile``), with dynamic shapes: each
    module of a class transformers lists in ``_no_split_modules`` (the decoder layers; a vision tower's
    blocks). The blocks share their compiled graphs (one for training, one for no-grad passes, every
    sequence length), so compiling costs one block's time, not the whole model's: the whole model
    through ``torch.compile`` had not finished its first step after 5 minutes on an H200 (2026-12-05).
    The embedding, the head and the loss stay eager (the head is ``fused_head_at``'s own chunked
    kernel). Parameter names and the state dict stay as they are (weight sync and checkpoints read
    them). A model that names no such blocks is compiled whole. Returns the number of blocks compiled
    (0: whole)."""
    names = {n for m in model.modules() for n in getattr(m, "_no_split_modules", None) or ()}
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        model.compile(dynamic=True)
        return 0
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The lr multiplier at optimizer step ``step`` (0-based): linear warm-up over ``warmup_steps``, then 1."""
    warm = max(warmup_steps, 0)
    return min(1.0, (step + 1) / warm) if warm else 1.0


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step, warmup_steps))


def adamw_with_warmup(
    params: list[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    warmup_steps: int,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """A fresh AdamW over ``params`` and its warm-up schedule; fused where ``fused_adamw`` says."""
    optimizer = torch.optim.AdamW(
        params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused_adamw(params) or None
    )
    return optimizer, warmup_schedule(optimizer, warmup_steps)


def fused_adamw(params: list[torch.nn.Parameter]) -> bool:
    """Whether AdamW takes its fused CUDA kernel (one launch over all parameters, against the multi-tensor
    default's several per group): where every parameter is a floating-point CUDA tensor (FSDP2's
    shards too). Its step counters then stay on the GPU, which ``HostParking`` leaves in place."""
    return bool(params) and all(p.device.type == "cuda" and p.dtype.is_floating_point for p in params)


def text_decoder_layers(model: Any) -> list[torch.nn.Module]:
    """A Hugging Face model's language-model decoder layers, in order (a vision-language model's text
    model's, not its vision tower's blocks): those of the ``layers`` list of its decoder
    (``get_decoder()``) that can be checkpointed (``GradientCheckpointingLayer``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None) or getattr(getattr(decoder, "model", None), "layers", None)
    return [m for m in layers or () if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_first_layers(model: Any, count: int) -> None:
    """Recompute the first ``count`` decoder layers' activations in backward, each keeping only its input
    (non-reentrant ``torch.utils.checkpoint`` through Hugging Face's per-layer flag, which runs inside
    the layer's ``__call__`` and so inside FSDP2's hooks on it: FSDP2 leaves the recompute's unshard to
    its pre-backward hook); the others keep their activations. 0: none. Other checkpointable modules
    (a vision tower's blocks) are checkpointed where any decoder layer is. Why the first layers:
    ``reroll.config.memory.kept_activations``. Can be called again to change the count."""
    layers = text_decoder_layers(model)
    if count > len(layers):
        raise UserError(
            f"model.gradient_checkpointing is {count}, but the model has {len(layers)} decoder layers: "
            f"set at most {len(layers)} (or true for all)"
        )
    if count == 0:
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers[count:]:
        layer.gradient_checkpointing = False


def start_checkpointing(model: Any, setting: bool | int | str, trainable: bool) -> None:
    """``model.gradient_checkpointing`` at a trainer's start: true every checkpointable module (Hugging
    Face's ``gradient_checkpointing_enable``, non-reentrant), a count the first that many decoder
    layers, false none; 'auto' none until the role's worker chooses its count from its first pass
    (``StrategyWorker``). Nothing for a role that does not train (it runs no backward)."""
    if not trainable or setting is False or setting == "auto":
        return
    if setting is True:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        checkpoint_first_layers(model, int(setting))


def set_trainable(model: torch.nn.Module, cfg: RunConfig, trainable: bool) -> None:
    """Train mode and gradients for a role's model: all of it where ``trainable``, except a
    vision-language model's vision tower unless ``model.train_vision``; nothing for a scoring role."""
    model.train(trainable)
    model.requires_grad_(trainable)
    if trainable and not cfg.model.train_vision:
        frozen = freeze_vision(model)
        if frozen:
            logger.info("model.train_vision is false: the vision tower's %d parameters are frozen", frozen)


def forward_logits(
    model: Any,
    device: torch.device,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    images: ImageInputs | None = None,
) -> torch.Tensor:
    """``model``'s output for right-padded rows (``attention_mask``) or packed rows (``position_ids``, no
    mask; the rows' bounds go along for attention that keeps them apart: ``packed_attention``):
    ``(B, T, V)`` logits, or a critic's ``(B, T, 1)``. ``images``: the rows' images (a vision-language
    model), whose positions the model computes itself (3D, from the image grids: none are passed)."""
    input_ids = to_device(input_ids, device)  # queued: the host does not wait for the GPU here
    packed: dict[str, Any] = {}
    if images is not None:
        if attention_mask is None:
            raise ValueError(PACKING_REFUSED)
        attention_mask = to_device(attention_mask, device)
        vision = model_inputs(model, input_ids, images)
        return model(input_ids=input_ids, attention_mask=attention_mask, **vision).logits
    if attention_mask is not None:
        attention_mask = to_device(attention_mask, device)
        if position_ids is None:
            position_ids = position_ids_from(attention_mask)
    else:
        packed = packed_kwargs(position_ids, device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=to_device(position_ids, device),
        **packed,
    )
    return out.logits


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    grad_norm: torch.Tensor,
    device: torch.device,
) -> dict[str, float]:
    """Step with already clipped gradients, unless their pre-clip ``grad_norm`` is not finite: then the
    gradients are dropped, nothing changes (weights, optimizer state, schedule) and ``skipped`` is 1.

    Returns ``grad_norm``, the ``lr`` used, ``skipped``, ``peak_memory_gb`` and on a GPU ``alloc_retries``."""
    lr = scheduler.get_last_lr()[0]
    norm = float(grad_norm)  # one wait for the GPU: whether to step depends on the norm
    skipped = not math.isfinite(norm)
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "grad_norm": norm,
        "lr": float(lr),
        "skipped": float(skipped),
        "peak_memory_gb": peak_memory_gb(device),
    } | alloc_retries(device)


@contextlib.contextmanager
def adapters_disabled(model: Any, lora: Any) -> Iterator[None]:
    """The base model inside: forward passes skip the LoRA adapters (the reference policy)."""
    if lora is None:
        raise RuntimeError("adapters_disabled needs strategy.lora")
    with model.disable_adapter():
        yield
