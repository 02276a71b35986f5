"""What the machine must have for a run, for ``reroll.pipelines.preflight``:

- ``package_problems``: the packages and programs the config needs, each with its install line: the
  generation engine (vLLM, SGLang) where actor_infer or the judge starts, DeepSpeed or Megatron-Core
  for ``strategy.name``, math-verify for ``math_verify`` rewards, bubblewrap for ``code_tests`` rewards
  in their default sandbox, gem-llm for a ``gem:<id>`` environment, and wandb / mlflow for the trackers
  ``logging`` asks for. Checked in the
  process that runs the check: on a Ray cluster every node needs the same packages.
- ``Machine``: the CPUs and GPUs of this machine, which ``reroll train`` makes into a Ray cluster of its
  own when it joins none (no ``runtime.ray_address``, no ``RAY_ADDRESS``); ``machine_problems`` checks
  the device pool and the roles against it, as ``train`` checks the cluster it starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from reroll.config.loader import ConfigProblem
from reroll.config.placement import cluster_problems
from reroll.config.schema import RunConfig
from reroll.packages import importable
from reroll.rewards import RENAMED
from reroll.rewards.routing import domain_terms, term_key

_TRAINERS = ("actor_train", "reference", "critic")


def package_problems(
    cfg: RunConfig, *, generate_only: bool = False, on: Literal["driver", "pool", "node"] = "driver"
) -> list[ConfigProblem]:
    """The packages and programs the config needs that this machine lacks (module doc); ``generate_only``:
    for the roles ``reroll generate`` starts. ``on``: what runs here: the driver, which needs every one
    (it logs to the trackers and tries the rewards), a node of the device pool (the roles' packages:
    engines, strategies, rewards, environments), or another node of the cluster (only roles that need
    no device land there: rewards and environments)."""
    from reroll.engines import engine_missing
    from reroll.runtime.metrics import tracker_missing
    from reroll.strategies import strategy_missing

    roles = cfg.started_roles(generate_only=generate_only) if on != "node" else []
    problems = []
    if "actor_infer" in roles and (missing := engine_missing(cfg.rollout.engine)):
        problems.append(ConfigProblem("rollout.engine", missing))
    reward = cfg.section("reward")
    judge = reward.judge if reward is not None and on != "node" else None
    if judge is not None and (missing := engine_missing(judge.engine)):
        problems.append(
            ConfigProblem("reward.judge.engine", missing.replace("rollout.engine", "reward.judge.engine"))
        )
    if any(r in roles for r in _TRAINERS) and (missing := strategy_missing(cfg.strategy.name)):
        problems.append(ConfigProblem("strategy.name", missing))
    if reward is not None:
        problems += _reward_packages(cfg, own_modules=on != "driver")
    agentic = cfg.section("agentic")
    if agentic is not None and agentic.env.startswith("gem:"):
        from reroll.envs.gem import gem_missing

        if missing := gem_missing():
            problems.append(ConfigProblem("agentic.env", f"is {agentic.env!r}: {missing}"))
    if on == "driver":
        lg = cfg.logging
        problems += [ConfigProblem(k, m) for k, m in tracker_missing(wandb=lg.wandb, mlflow=lg.mlflow)]
    return problems


def _reward_packages(cfg: RunConfig, *, own_modules: bool = False) -> list[ConfigProblem]:
    """What the rewards' functions need here; ``own_modules``: a ``module:function`` of the user's too
    (on another node of a cluster: the driver's checks import them where it runs)."""
    problems = []
    for domain, terms in domain_terms(cfg.reward).items():
        for i, term in enumerate(terms):
            key, name = f"{term_key(cfg.reward, domain, i)}.fn", RENAMED.get(term.fn, term.fn)
            if own_modules and ":" in name and not importable(module := name.split(":", 1)[0]):
                problems.append(
                    ConfigProblem(
                        key,
                        f"{name!r}: module {module!r} is not importable here: ship it with the job (`ray job "
                        "submit --working-dir .`) or install it on every node",
                    )
                )
            if name == "math_verify" and not importable("math_verify"):
                from reroll.rewards.math import MISSING

                problems.append(ConfigProblem(key, MISSING))
            if name == "code_tests" and term.args.get("sandbox", "bubblewrap") == "bubblewrap":
                from reroll.rewards.bwrap import bubblewrap_problem

                if problem := bubblewrap_problem():
                    problems.append(ConfigProblem(key, f"reward 'code_tests': {problem}"))
    return problems


@dataclass(frozen=True)
class Machine:
    """The CPUs and GPUs a Ray cluster started on a machine gets."""

    cpus: float
    gpus: int
    gpu_memory_gib: float | None = None  # the smallest GPU's memory, where NVML tells it

    @classmethod
    def here(cls) -> Machine:
        """This machine, counted as ``ray.init`` counts it (CPU quota of its cgroup; visible GPUs)."""
        import torch

        try:
            from ray._private.utils import get_num_cpus  # what ray.init gives a local cluster

            cpus = float(get_num_cpus())
        except Exception:  # another Ray version: the CPUs this process may run on
            cpus = float(len(os.sched_getaffinity(0)))
        gpus = torch.cuda.device_count()
        return cls(cpus=cpus, gpus=gpus, gpu_memory_gib=_gpu_memory_gib() if gpus else None)

    def device_type(self, cfg: RunConfig) -> str:
        """``placement.device_type``, 'auto' resolved as a run on this machine resolves it."""
        kind = cfg.placement.device_type
        return kind if kind != "auto" else ("cuda" if self.gpus else "cpu")


def _gpu_memory_gib() -> float | None:
    """The smallest visible GPU's memory in GiB, from NVML (nvidia-ml-py, which vLLM installs), which
    opens no CUDA context in this process as torch's device properties would; None without it. Counts
    every GPU of the machine, CUDA_VISIBLE_DEVICES aside."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            sizes = [
                pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                for i in range(count)
            ]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML binding or driver: the share is checked by the engine at start
        return None
    return min(sizes) / 2**30 if sizes else None


def starts_own_cluster(cfg: RunConfig) -> bool:
    """Whether ``reroll train`` would start a Ray cluster on this machine rather than join one."""
    return cfg.runtime.backend == "ray" and not cfg.runtime.ray_address and not os.environ.get("RAY_ADDRESS")


def machine_problems(cfg: RunConfig, machine: Machine, *, generate_only: bool = False) -> list[ConfigProblem]:
    """What a run on ``machine`` cannot hold: a CUDA device type without a GPU; the device pool and the
    roles' resources against the Ray cluster ``train`` starts there (runtime.backend ray)."""
    kind = machine.device_type(cfg)
    if kind == "cuda" and not machine.gpus:
        return [
            ConfigProblem(
                "placement.device_type",
                "is 'cuda' but this machine has no GPU that torch sees: set placement.device_type to auto "
                "(or cpu), or run on a machine with a GPU (or join a cluster that has them: runtime.ray_address)",
            )
        ]
    if cfg.runtime.backend == "local":
        return []
    here = (
        f"on this machine ({machine.cpus:g} CPUs, {machine.gpus} GPUs; train starts a Ray cluster of its "
        f"own here, as neither runtime.ray_address nor RAY_ADDRESS is set)"
    )
    resources = {"CPU": machine.cpus, "GPU": float(machine.gpus)}
    return [
        ConfigProblem(path, f"{here}: {m}")
        for path, m in cluster_problems(cfg, resources, kind, generate_only=generate_only)
    ]
