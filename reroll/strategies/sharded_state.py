"""A trainer's state for resuming, in torch's distributed checkpoint format (DCP): ``<checkpoint>/state/``.

Every rank writes its own shards of the weights and of the optimizer's moments (a full copy per rank,
the torch strategy's, is written once, split between the ranks), under the names the tensors have in
the model (``model.*``; ``optimizer.state.<parameter name>.exp_avg``, ...), with the schedule beside
them; DCP's ``.metadata`` says where each piece of each tensor lies. Any number of ranks, sharded or
not, reads it back: each reads the pieces of its own shards (``load_state``). So a run saved by 2
FSDP2 ranks resumes on 1 or 4, or on the torch strategy.

With LoRA only what trains (the adapters, and modules trained in full) is kept: the frozen base is
the run's ``model.path``. A checkpoint written before this format holds no ``state/``
(``load_state`` returns False and the strategy reads the older files).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STATE = "state"  # the directory inside a checkpoint


def save_state(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    *,
    with_optimizer: bool,
    keep: Callable[[str], bool] | None = None,
) -> None:
    """Write ``directory/state`` (every rank calls it): the model's tensors (those ``keep`` names, or
    all), and, ``with_optimizer``, the optimizer and schedule where the optimizer has taken a step (a
    fresh one has nothing to keep, and resuming configures a fresh one anyway)."""
    state: dict[str, Any] = {"model": _model_state(model, keep)}
    if with_optimizer and optimizer is not None and optimizer.state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        state["scheduler"] = scheduler.state_dict()
    dcp.save(state, checkpoint_id=str(directory / STATE), no_dist=not dist.is_initialized())


def load_state(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    *,
    keep: Callable[[str], bool] | None = None,
) -> bool:
    """Read ``directory/state`` into this rank's shards (every rank calls it): the model's tensors
    (``keep`` as when saved), and the optimizer and schedule where both the checkpoint and this
    strategy have one. False, reading nothing, where there is no ``state/`` (an older checkpoint)."""
    path = directory / STATE
    if not (path / ".metadata").is_file():
        return False
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state: dict[str, Any] = {"model": _model_state(model, keep)}
    with_optimizer = optimizer is not None and any(k.startswith("optimizer.") for k in saved)
    if with_optimizer:
        # a fresh optimizer has no moments yet: this makes them (a step at lr 0), to be overwritten
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        state["scheduler"] = scheduler.state_dict()
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    options = StateDictOptions(strict=keep is None)
    set_model_state_dict(model, state["model"], options=options)
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return True


def _model_state(model: torch.nn.Module, keep: Callable[[str], bool] | None) -> dict[str, Any]:
    state = get_model_state_dict(model)
    return state if keep is None else {k: v for k, v in state.items() if keep(k)}
