"""The roles a run may start, each named once here: what it holds, and its ``roles.<role>`` section.

``ROLES`` is the one list: the ``roles`` config section has a key per entry, and which of them a run
starts is ``reroll.config.placement.run_roles`` (from the pipeline's config model). A role holds a
training strategy (``strategy``: actor_train, reference, critic, teacher, learned_reward), a generation
engine (``engine``: actor_infer, judge) or plain workers (``workers``: reward, env).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, create_model, model_validator

from reroll.config.base import StrictModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleKind:
    """What a role is, whatever the run."""

    holds: Literal["strategy", "engine", "workers"]
    on_pool: bool  # holds a model on a device of the pool (others take pool devices only if given some)
    trainable: bool  # takes optimizer steps
    description: str


ROLES: dict[str, RoleKind] = {
    "actor_train": RoleKind("strategy", True, True, "The policy being trained."),
    "actor_infer": RoleKind("engine", True, False, "The generation engine."),
    "reference": RoleKind("strategy", True, False, "Frozen policy for the KL term."),
    "critic": RoleKind("strategy", True, True, "The value function (if `critic:` is set)."),
    "reward": RoleKind("workers", False, False, "Reward function workers."),
    "judge": RoleKind("engine", False, False, "The LLM judge's engine (if `reward.judge` is set)."),
    "env": RoleKind(
        "workers", False, False, "Environment workers, each hosting many episodes (pipeline agentic)."
    ),
    "teacher": RoleKind(
        "strategy",
        True,
        False,
        "Distillation teachers (pipeline distill); every teacher of distill.teachers is placed so.",
    ),
    "learned_reward": RoleKind(
        "strategy",
        True,
        False,
        "The trained reward model that scores RLHF's samples (if `reward.model` is set).",
    ),
}


class RoleConfig(StrictModel):
    """Where one role's workers run."""

    world_size: int = Field(
        1,
        ge=1,
        description="Number of workers: data-parallel ranks; with strategy.name=megatron, all ranks "
        "(tensor_parallel x pipeline_parallel x data-parallel, and x strategy.megatron.context_parallel for "
        "actor_train and the reference); with strategy.context_parallel (actor_train, reference), "
        "context_parallel x data-parallel.",
    )
    num_gpus_per_worker: float = Field(0.0, ge=0, description="GPUs per worker; fractions colocate roles.")
    num_cpus_per_worker: float = Field(0.25, gt=0, description="Ray CPU resource per worker.")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker. Default on CPU: its pool device's placement.cpus_per_device "
        "(at least 1), or without a pool the machine's cores over world_size (roles take turns); on a "
        "GPU, Ray's (the worker's num_cpus, at least 1); in-process (runtime.backend local), all cores.",
    )
    devices: list[int] | None = Field(
        None,
        description="Pool devices (placement.devices) this role's ranks use, rank r on "
        "devices[r * len(devices) // world_size]; roles sharing a device are colocated. Default with a "
        "pool: the first world_size devices.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each worker asks for, to pin the role to nodes: {node_b: 1} "
        "runs it only on nodes started with `ray start --resources '{\"node_b\": N}'`. On the pool, the "
        "bundles of the role's devices ask for them.",
    )


# keys that were renamed: the old one still works, with a one-line deprecation message
RENAMED = {"reward_model": "learned_reward"}  # one name per thing: reward_model is a pipeline too


class _Roles(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for old, new in RENAMED.items():
            if old in data and new not in data:
                log.warning(
                    "roles.%s is now roles.%s (the role that serves reward.model); the old name still works",
                    old,
                    new,
                )
                data = {(new if k == old else k): v for k, v in data.items()}
        return data


RolesConfig = create_model(
    "RolesConfig",
    __base__=_Roles,
    __doc__="Placement of each role.",
    __module__=__name__,
    **{
        name: (RoleConfig, Field(default_factory=RoleConfig, description=k.description))
        for name, k in ROLES.items()
    },
)
