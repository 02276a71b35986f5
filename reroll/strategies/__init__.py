"""Training backends behind one interface (``Strategy``): torch, fsdp2, deepspeed, megatron.

``make_strategy`` is the one place a name becomes a backend; each backend's module (and its heavy
dependency) is imported only when that backend is built, so ``import reroll`` needs none of them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from reroll.config.placement import trainer_strategy
from reroll.config.startable import context_parallel_strategy_problem
from reroll.errors import UserError
from reroll.packages import importable

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig
    from reroll.data.types import ImageInputs
    from reroll.strategies.micro_batches import MB, Record, RouterLoss

Head = Literal["causal_lm", "value", "reward"]


class SavedAtOtherWorldSize(Exception):
    """A checkpoint whose optimizer state only the world size it was saved at can read (``saved`` ranks;
    this role has ``current``): ``why`` says which format it is. The worker turns it into the error
    that names the role's ``world_size`` key."""

    def __init__(self, directory: Path, saved: int, current: int, why: str) -> None:
        super().__init__(f"{directory}: {why}, saved by {saved} ranks; this role has {current}")
        self.directory, self.saved, self.current, self.why = directory, saved, current, why


class Strategy(Protocol):
    """What actor_train, reference and critic need from a training backend.

    Losses reach ``backward`` already normalised by the token/sequence counts of the whole optimizer
    step (all micro-batches, all ranks): a backend must *sum* gradients over micro-batches and ranks.
    """

    fused_head: bool
    """Whether the model's head is a plain module whose weight its forward sees whole, so that it may
    compute the scored tokens' log-probs itself (``reroll.roles.scored_tokens.fused_head_at``)."""

    def init_distributed(self, address: str) -> None:
        """Join the role's process group at ``tcp://address`` (a no-op for one rank)."""
        ...

    def configure_optimizer(
        self, *, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int
    ) -> None:
        """A fresh AdamW with linear warm-up to ``lr`` then constant."""
        ...

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        images: ImageInputs | None = None,
    ) -> torch.Tensor:
        """The model's output for ``(B, T)`` rows: ``(B, T, V)`` logits, or a critic's ``(B, T, 1)``.

        ``position_ids`` given and ``attention_mask`` None means packed rows (positions restart at 0
        at each sequence start; attention stays within a sequence). ``images``: the rows' images, for a
        vision-language model (right-padded rows only; the model computes its own positions)."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def train_micro_batches(
        self,
        batches: Sequence[MB],
        loss_of: Callable[[MB], tuple[torch.Tensor, Record]],
        router: RouterLoss | None = None,
    ) -> list[Record]:
        """Backpropagate the loss of every micro-batch of a step, ``loss_of(mb) -> (loss, record)``, a
        mixture of experts' ``router`` term added; the records in order. One after the other
        (``reroll.strategies.micro_batches.MicroBatchLoop``), or scheduled where the strategy can
        (Megatron's pipeline stages)."""
        ...

    def score_micro_batches(self, batches: Sequence[MB], output_of: Callable[[MB], Record]) -> list[Record]:
        """``output_of(mb)`` of every micro-batch of a forward-only pass, in order."""
        ...

    def step(self, grad_clip: float) -> dict[str, float]:
        """Reduce gradients, clip, step: ``{"grad_norm": pre-clip norm, "lr": lr used, "skipped": 0/1}``.

        A non-finite global norm skips the update on every rank alike (gradients dropped, weights,
        optimizer state and schedule unchanged) and reports ``skipped`` 1."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight the engine needs, unsharded, on CPU, in Hugging Face names."""
        ...

    def save(self, directory: Path, *, with_optimizer: bool) -> None: ...

    def load(self, directory: Path) -> None: ...

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state off the accelerator (colocation)."""
        ...

    def reload(self) -> None:
        """Bring back what ``offload`` moved."""
        ...

    def prepare_offload(self, worth_it: Callable[[int], bool]) -> None:
        """Where ``worth_it(bytes)`` says of the state ``offload`` would move that it is likely to move,
        make that state's host buffers ready ahead, in the background (``HostParking.prepare``), so that
        the first ``offload`` only copies; returns at once. A no-op where the strategy moves its state
        its own way."""
        ...


# the backends whose ranks can split each sequence (make_strategy's context_parallel)
SPLITS_SEQUENCES = ("fsdp2", "megatron")

# strategy name -> (module, class, package that must import, how to install it)
_BACKENDS = {
    "torch": ("reroll.strategies.torch_strategy", "TorchStrategy", None, ""),
    "fsdp2": ("reroll.strategies.fsdp2", "FSDP2Strategy", None, ""),
    "deepspeed": (
        "reroll.strategies.deepspeed",
        "DeepSpeedStrategy",
        "deepspeed",
        "pip install 'reroll[deepspeed]'",
    ),
    "megatron": (
        "reroll.strategies.megatron",
        "MegatronStrategy",
        "megatron.core",
        "pip install 'reroll[megatron]' (GPU machines)",
    ),
}


def strategy_available(name: str) -> bool:
    """Whether ``name``'s backend package can be imported here."""
    package = _BACKENDS[name][2]
    return package is None or importable(package)


def strategy_missing(name: str) -> str | None:
    """Why strategy ``name`` cannot be built here (its backend package is not installed), with the
    install line; None when it can."""
    if name not in _BACKENDS or strategy_available(name):
        return None
    _, _, package, install = _BACKENDS[name]
    return (
        f"strategy.name is {name!r} but the '{package}' package is not installed here: {install}, "
        "or set strategy.name=fsdp2"
    )


def make_strategy(
    cfg: RunConfig,
    *,
    model_path: str,
    device: str,
    trainable: bool,
    rank: int,
    world_size: int,
    head: Head,
    context_parallel: int = 1,
) -> Strategy:
    """The backend ``cfg.strategy.name`` names ('auto' resolved for ``device``, as the run resolves it:
    ``reroll.config.placement.trainer_strategy``), holding the model at ``model_path``;
    ``context_parallel``: the size of the groups that split each sequence (fsdp2 and megatron).

    A backend that is not installed is a ``UserError`` saying what to install.
    """
    name = trainer_strategy(cfg, device)
    module, cls_name, _, _ = _BACKENDS[name]
    missing = strategy_missing(name)
    if missing:
        raise UserError(missing)
    if context_parallel > 1 and name not in SPLITS_SEQUENCES:
        raise UserError(context_parallel_strategy_problem(context_parallel, name))
    cls = getattr(importlib.import_module(module), cls_name)
    extra = {"context_parallel": context_parallel} if name in SPLITS_SEQUENCES else {}
    return cls(
        model_path,
        cfg=cfg,
        device=device,
        trainable=trainable,
        rank=rank,
        world_size=world_size,
        head=head,
        **extra,
    )
