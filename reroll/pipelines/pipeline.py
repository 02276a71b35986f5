"""The ``Pipeline`` base class: one pipeline's part of a run, which ``reroll.pipelines.run.run`` drives.

A pipeline (rlvr, agentic, sft, ...) loads its data in ``__init__`` (before any role starts, so bad
input costs nothing) and supplies one step, its evaluation, its warm start and the state it
checkpoints. Which roles the run starts is its config's (``RunConfig.started_roles``); that actor_infer
holds actor_train's weights before each step and evaluation is the run's duty, not the pipeline's.
Pipelines are found by name (``pipeline_class``): the built-in ones, and any class registered with
``register_pipeline`` (or named by import path, 'package.module:Class', whose module registers it).
"""

from __future__ import annotations

import importlib
import pickle
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from reroll.config.run import RunConfig
from reroll.pipelines.roles import Roles


@dataclass(frozen=True)
class LearningRate:
    """A learning-rate schedule: linear warm-up over ``warmup_steps``, then constant at ``lr``."""

    lr: float
    warmup_steps: int = 0


@dataclass
class Checkpointed:
    """What a pipeline saves beside the model: JSON state (``trainer_state.json``) and torch objects
    saved under their file names."""

    state: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)


class Pipeline:
    """One pipeline's part of a run. ``__init__`` loads the data (before any role starts, so bad input
    costs nothing); ``run`` then starts the config's roles and calls the rest."""

    name: ClassVar[str]
    evaluate_uses: ClassVar[tuple[str, ...]] = ("actor_infer",)  # the roles ``evaluate`` calls

    @property
    def step_generates(self) -> bool:
        """Whether ``step`` generates with actor_infer (the run syncs its weights first)."""
        return True

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    @property
    def total_steps(self) -> int:
        return self.cfg.total_steps

    def texts(self) -> Iterable[str]:
        """The text the model will read and write (prompts, targets), checked at start for characters
        the tokenizer cannot represent."""
        return ()

    def learning_rate(self) -> LearningRate:
        """actor_train's learning rate and warm-up steps for the loop."""
        return LearningRate(self.cfg.optim.lr, self.cfg.optim.warmup_steps)

    def warm_start(self, roles: Roles) -> None:
        """A fresh run's preparation before step 1 (an SFT warm start); nothing by default."""

    def restore(self, saved: dict[str, Any], directory: Path) -> None:
        """Resume the pipeline's own state from a checkpoint (the models are loaded already)."""

    def checkpointed(self) -> Checkpointed:
        return Checkpointed()

    def snapshot(self) -> Checkpointed:
        """The state ``checkpointed`` saves, copied in memory: a step retried after a worker died
        ``rewind``s to it and draws the same prompts, so every sample is counted once. Copied through
        pickle (what a checkpoint saves must pickle): a step's queued responses (async, tail batching)
        are lists of token ids, which ``copy.deepcopy`` copies an int at a time, about twice as slow."""
        return pickle.loads(pickle.dumps(self.checkpointed(), protocol=pickle.HIGHEST_PROTOCOL))

    def rewind(self, saved: Checkpointed) -> None:
        """Back to a ``snapshot``, through ``restore`` (the path a resumed run takes)."""
        with tempfile.TemporaryDirectory(prefix="reroll-rewind-") as tmp:
            for name, obj in saved.objects.items():
                torch.save(obj, Path(tmp) / name)
            self.restore(saved.state, Path(tmp))

    def step(self, roles: Roles, step: int) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self, roles: Roles) -> dict[str, float]:
        """Held-out metrics (``eval/accuracy`` first of all), run inside the ``evaluate`` phase."""
        return {}

    def sample_line(self) -> str | None:
        """A line showing one of the last step's samples, as the model saw it."""
        return None

    def headroom(self, metrics: dict[str, float]) -> str | None:
        """What step 0's held-out ``metrics`` say about the room the loop has to learn (a warning), or
        None; nothing by default."""
        return None


def every(n: int, step: int, total: int, *, at_end: bool = True) -> bool:
    """Whether an every-``n``-steps duty falls on ``step``: every ``n``-th step (none with n=0) and, unless
    ``at_end`` is off, the last, so a finished run is evaluated and checkpointed."""
    return (n > 0 and step % n == 0) or (at_end and step == total)


_PIPELINES: dict[str, type[Pipeline]] = {}


def register_pipeline(cls: type[Pipeline]) -> type[Pipeline]:
    """Make ``cls`` the pipeline its ``name`` names (a class decorator; its config model is registered
    with ``reroll.config.run.register_pipeline_config``)."""
    _PIPELINES[cls.name] = cls
    return cls


def pipeline_class(name: str) -> type[Pipeline]:
    """The pipeline ``pipeline: <name>`` names: a built-in one (imported on demand: each pulls in its own
    roles), or a registered one; for 'package.module:Class', importing the module registers it."""
    if name not in _PIPELINES:
        module = _BUILT_IN.get(name) or name.partition(":")[0]
        importlib.import_module(module)
    return _PIPELINES[name]


_BUILT_IN = {
    "rlvr": "reroll.pipelines.rlvr",
    "sft": "reroll.pipelines.sft",
    "agentic": "reroll.pipelines.agentic",
    "reward_model": "reroll.pipelines.reward_model",
    "dpo": "reroll.pipelines.dpo",
    "distill": "reroll.pipelines.distill",
}
