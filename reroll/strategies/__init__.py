"""Training backends. One interface: model forward, backward, step, full weights, save/load."""

from __future__ import annotations

from typing import Protocol

import torch


class Strategy(Protocol):
    """What the trainer and reference roles need from a training backend."""

    def init_distributed(self, address: str) -> None: ...
    def configure_optimizer(
        self, *, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int
    ) -> None: ...
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self, grad_clip: float) -> dict[str, float]: ...
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
