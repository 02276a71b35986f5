"""What a config says about placement: which pool devices each role's ranks use, checked and pure.

The config names a pool of ``placement.devices`` devices (GPUs, or CPU slots on a CPU-only cluster)
and, per role, the pool devices its ranks use (``roles.<role>.devices``). Rank ``r`` of a role with
``n`` ranks on ``d`` devices sits on ``devices[r * d // n]``; roles that share a device are
colocated. Nothing here touches Ray or a device, so ``reroll validate``, ``reroll plan`` and the run
(``reroll.runtime.placement``, which reserves the devices) all read the same map.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

# Roles that hold a model on a device; reward (and judge) workers run on CPUs unless given devices.
DEVICE_ROLES = ("actor_train", "actor_infer", "reference", "critic", "teacher", "reward_model")


@dataclass(frozen=True)
class DeviceMap:
    """The device of every rank of every placed role."""

    device_type: str  # "cuda" | "cpu"
    num_devices: int
    ranks: dict[str, tuple[int, ...]]  # role -> (first) device of rank r
    span: dict[str, int] = field(default_factory=dict)  # role -> devices per rank (a tensor-parallel engine)

    def covered(self, role: str) -> set[int]:
        k = self.span.get(role, 1)
        return {d + i for d in self.ranks[role] for i in range(k)}

    def workers_on(self, device: int) -> list[tuple[str, int]]:
        return [
            (role, r)
            for role, devs in self.ranks.items()
            for r, d in enumerate(devs)
            if d <= device < d + self.span.get(role, 1)
        ]

    def colocated(self, a: str, b: str) -> bool:
        return a in self.ranks and b in self.ranks and bool(self.covered(a) & self.covered(b))

    def table(self) -> str:
        """One line per device: ``device 0: actor_train[0] actor_infer[0]``."""
        lines = []
        for d in range(self.num_devices):
            names = " ".join(f"{role}[{r}]" for role, r in self.workers_on(d)) or "(unused)"
            lines.append(f"  {self.device_type} device {d}: {names}")
        return "\n".join(lines)


def rank_span(cfg: RunConfig, role: str) -> int:
    """Devices one rank of ``role`` takes: a vLLM engine's tensor-parallel size, else 1."""
    if role == "actor_infer" and cfg.rollout.engine == "vllm":
        return cfg.rollout.vllm.tensor_parallel_size
    return 1


def role_devices(cfg: RunConfig, role: str) -> list[int]:
    """``roles.<role>.devices``, or by default the first ``world_size`` (x span) devices of the pool."""
    rc = getattr(cfg.roles, role)
    if rc.devices is not None:
        return list(rc.devices)
    return list(range(min(rc.world_size * rank_span(cfg, role), cfg.placement.devices or 1)))


def placed_roles(cfg: RunConfig, roles: Iterable[str]) -> list[str]:
    """The roles of this run that take devices from the pool."""
    return [r for r in roles if r in DEVICE_ROLES or getattr(cfg.roles, r).devices is not None]


def trainer_strategy(cfg: RunConfig, device: str) -> str:
    """``strategy.name`` with 'auto' resolved for trainer ranks on ``device`` ('cuda' or 'cpu'): fsdp2 on
    GPUs; torch on CPUs, where sharding saves no memory worth having and one fsdp2 rank's step is
    slower (about 1.4x on the tiny model, 2 cores). The run resolves it once, in ``ResourceManager``
    with the device actor_train's ranks get, and writes it to config.yaml; ``make_strategy`` applies
    the same rule to a config that did not pass there (tests, benchmarks)."""
    name = cfg.strategy.name
    if name != "auto":
        return name
    return "fsdp2" if device == "cuda" else "torch"


def device_map(cfg: RunConfig, roles: Iterable[str], device_type: str) -> DeviceMap:
    """Where each rank of ``roles`` sits (``check_placement`` has vetted the config)."""
    ranks, span = {}, {}
    for role in placed_roles(cfg, roles):
        devs, n, k = role_devices(cfg, role), getattr(cfg.roles, role).world_size, rank_span(cfg, role)
        if k > 1:  # each rank takes k consecutive devices of its list
            ranks[role], span[role] = tuple(devs[r * k] for r in range(n)), k
        else:
            ranks[role] = tuple(devs[r * len(devs) // n] for r in range(n))
    return DeviceMap(device_type, cfg.placement.devices or 0, ranks, span)


def check_placement(cfg: RunConfig) -> list[tuple[str, str]]:
    """Config-level problems as ``(dotted path, message)``: devices outside the pool, uneven splits."""
    problems = []
    pool = cfg.placement.devices
    for role in type(cfg.roles).model_fields:
        rc = getattr(cfg.roles, role)
        if rc.devices is None:
            continue
        path = f"roles.{role}.devices"
        if pool is None:
            problems.append((path, "needs placement.devices (the size of the device pool) to be set"))
            continue
        outside = [d for d in rc.devices if not 0 <= d < pool]
        if outside:
            problems.append(
                (path, f"devices {outside} are outside the pool of placement.devices={pool} (0..{pool - 1})")
            )
        if len(set(rc.devices)) != len(rc.devices):
            problems.append((path, f"{rc.devices} lists a device twice"))
        k = rank_span(cfg, role)
        if k > 1 and len(rc.devices) != rc.world_size * k:
            problems.append(
                (
                    path,
                    f"each of the {rc.world_size} engine ranks takes rollout.vllm.tensor_parallel_size={k} "
                    f"devices: list exactly {rc.world_size * k} devices, not {len(rc.devices)}",
                )
            )
        elif rc.world_size % len(rc.devices):
            problems.append(
                (
                    path,
                    f"roles.{role}.world_size ({rc.world_size}) ranks cannot spread evenly over "
                    f"{len(rc.devices)} devices {rc.devices}: use a world_size that is a multiple of "
                    f"{len(rc.devices)}",
                )
            )
    return problems


def offload_between_phases(cfg: RunConfig, device_type: str) -> bool:
    """Whether colocated roles offload: ``placement.offload`` 'auto' means only on GPUs."""
    mode = cfg.placement.offload
    return mode == "always" or (mode == "auto" and device_type == "cuda")


def started_roles(cfg: RunConfig) -> list[str]:
    """Every role a run of ``cfg`` starts: the model roles, then reward, judge or env workers."""
    roles = run_roles(cfg)
    roles += ["env"] if cfg.pipeline == "agentic" else ["reward"]
    roles += ["judge"] if cfg.reward.judge is not None and cfg.pipeline != "agentic" else []
    return roles


def cluster_problems(cfg: RunConfig, resources: dict[str, float], device_type: str) -> list[tuple[str, str]]:
    """What the Ray cluster with ``resources`` (``ray.cluster_resources()``) cannot hold, as ``(dotted
    path, message)``: the device pool, and the GPUs and CPUs the roles off the pool ask for."""
    pool, problems = cfg.placement.devices, []
    need = {"GPU": 0.0, "CPU": 0.0}
    if pool:
        kind = "GPU" if device_type == "cuda" else "CPU"
        per = 1.0 if kind == "GPU" else cfg.placement.cpus_per_device
        if resources.get(kind, 0) < pool * per:
            table = device_map(cfg, run_roles(cfg), device_type).table()
            problems.append(
                (
                    "placement",
                    f"the pool needs {pool * per:g} {kind} ({pool} devices) but the Ray cluster has "
                    f"{resources.get(kind, 0):g}:\n{table}\nfix: lower placement.devices and the roles' "
                    "devices/world_size to fit, or join a bigger cluster (runtime.ray_address)",
                )
            )
            return problems
        need["CPU"] += pool * cfg.placement.cpus_per_device
    roles = started_roles(cfg)
    off_pool = [r for r in roles if not pool or r not in placed_roles(cfg, [r])]
    asks = {
        kind: {r: getattr(cfg.roles, r).world_size * getattr(getattr(cfg.roles, r), attr) for r in off_pool}
        for kind, attr in (("GPU", "num_gpus_per_worker"), ("CPU", "num_cpus_per_worker"))
    }
    for kind, per_role in asks.items():
        total = need[kind] + sum(per_role.values())
        if total > resources.get(kind, 0) + 1e-9:
            listed = ", ".join(f"{r} {v:g}" for r, v in per_role.items() if v)
            pooled = f", the pool {need[kind]:g}" if need[kind] else ""
            problems.append(
                (
                    "roles",
                    f"the run asks Ray for {total:g} {kind} ({listed}{pooled}) but the cluster has "
                    f"{resources.get(kind, 0):g}: lower roles.<role>.world_size or "
                    f"num_{kind.lower()}s_per_worker, or join a bigger cluster (runtime.ray_address)",
                )
            )
    return problems


def run_roles(cfg: RunConfig) -> list[str]:
    """The model roles a run of ``cfg`` starts."""
    roles = ["actor_train", "actor_infer"]
    if cfg.needs_reference:
        roles.append("reference")
    if cfg.critic is not None:
        roles.append("critic")
    if cfg.pipeline == "distill":
        roles.append("teacher")
    if cfg.reward.model is not None:
        roles.append("reward_model")
    return roles


def shares_device(cfg: RunConfig, role: str) -> bool:
    """Whether a rank of ``role`` shares a pool device with another role of the run."""
    if not cfg.placement.devices:
        return False
    dmap = device_map(cfg, run_roles(cfg), cfg.placement.device_type)
    return any(dmap.colocated(role, other) for other in dmap.ranks if other != role)


def weight_sync_transport(cfg: RunConfig, device_type: str) -> str:
    """'cuda_ipc' or 'object_store': ``rollout.weight_sync_transport`` with 'auto' resolved. CUDA IPC
    needs every actor_infer rank on actor_train rank 0's GPU (it gathers the full weights) and an
    in-process engine (the tensors are opened in the worker's process)."""
    mode = cfg.rollout.weight_sync_transport
    if mode != "auto":
        return mode
    if device_type != "cuda" or not cfg.placement.devices:
        return "object_store"
    if cfg.rollout.engine == "vllm" and not cfg.rollout.vllm.in_process:
        return "object_store"
    dmap = device_map(cfg, run_roles(cfg), device_type)
    trainer0 = dmap.ranks["actor_train"][0]
    return "cuda_ipc" if all(d == trainer0 for d in dmap.ranks["actor_infer"]) else "object_store"


def colocated_trainer_roles(cfg: RunConfig, role: str) -> int:
    """How many roles that hold a training strategy (actor_train, reference, critic, teacher,
    reward_model) share a device
    with rank 0 of ``role``, ``role`` included (1 without a pool)."""
    if not cfg.placement.devices:
        return 1
    dmap = device_map(cfg, run_roles(cfg), cfg.placement.device_type)
    device = dmap.ranks[role][0]
    return len({r for r, _ in dmap.workers_on(device) if r != "actor_infer"})
