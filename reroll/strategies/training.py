"""What the strategies that hold a Hugging Face model under a torch optimizer share: the warm-up
schedule, the forward pass over padded or packed rows, the finite-norm guarded step (a non-finite
gradient norm skips the update), moving optimizer
state for offload, and the LoRA reference switch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from reroll.models.loading import position_ids_from
from reroll.strategies.memory import alloc_retries, peak_memory_gb


def compile_model(model: torch.nn.Module) -> None:
    """``torch.compile`` the whole model in place (``model.compile``), with dynamic shapes: one graph
    for training and one for no-grad passes serve every sequence length, and parameter names and the
    state dict stay as they are (weight sync and checkpoints read them). Compiling each decoder layer
    instead recompiles per layer (Hugging Face attention reads its ``layer_idx``), past dynamo's cache
    limit of 8, after which the layers run eagerly: measured on an H200, no gain."""
    model.compile(dynamic=True)


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
    """A fresh AdamW over ``params`` and its warm-up schedule."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    return optimizer, warmup_schedule(optimizer, warmup_steps)


def forward_logits(
    model: Any,
    device: torch.device,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> torch.Tensor:
    """``model``'s output for right-padded rows (``attention_mask``) or packed rows (``position_ids``, no
    mask): ``(B, T, V)`` logits, or a critic's ``(B, T, 1)``."""
    input_ids = input_ids.to(device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        if position_ids is None:
            position_ids = position_ids_from(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids.to(device))
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
    skipped = not bool(torch.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "grad_norm": float(grad_norm),
        "lr": float(lr),
        "skipped": float(skipped),
        "peak_memory_gb": peak_memory_gb(device),
    } | alloc_retries(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
    """Adam's moments to ``device``; the step counters stay where they are (a non-capturable AdamW wants
    them on the CPU)."""
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":
                state[k] = v.to(device)


@contextlib.contextmanager
def adapters_disabled(model: Any, lora: Any) -> Iterator[None]:
    """The base model inside: forward passes skip the LoRA adapters (the reference policy)."""
    if lora is None:
        raise RuntimeError("adapters_disabled needs strategy.lora")
    with model.disable_adapter():
        yield
