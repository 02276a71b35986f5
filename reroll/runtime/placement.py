"""Placement: which devices each role's ranks use, and the Ray placement group that holds them.

The config names a pool of ``placement.devices`` devices (GPUs, or CPU slots on a CPU-only cluster)
and, per role, the pool devices its ranks use (``roles.<role>.devices``). Rank ``r`` of a role with
``n`` ranks on ``d`` devices sits on ``devices[r * d // n]``. Roles that share a device are colocated:
Ray gives each worker on a device an equal fraction of it, and the pipeline offloads the roles a phase
does not use (``Colocation``). ``device_map`` is pure, so ``reroll validate`` and ``reroll plan`` show
the same map the run uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reroll.errors import UserError

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

log = logging.getLogger(__name__)

# Roles that hold a model on a device; reward (and judge) workers run on CPUs unless given devices.
DEVICE_ROLES = ("actor_train", "actor_infer", "reference", "critic")


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


def worker_device(cfg: RunConfig, role: str) -> str:
    """'cuda' or 'cpu' for ``role``'s workers, in a config whose ``placement.device_type`` the
    ``ResourceManager`` has resolved (``auto`` counts as cpu here)."""
    if cfg.placement.devices and role in placed_roles(cfg, [role]):
        return "cuda" if cfg.placement.device_type == "cuda" else "cpu"
    return "cuda" if getattr(cfg.roles, role).num_gpus_per_worker > 0 else "cpu"


def offload_between_phases(cfg: RunConfig, device_type: str) -> bool:
    """Whether colocated roles offload: ``placement.offload`` 'auto' means only on GPUs."""
    mode = cfg.placement.offload
    return mode == "always" or (mode == "auto" and device_type == "cuda")


def run_roles(cfg: RunConfig) -> list[str]:
    """The model roles a run of ``cfg`` starts."""
    roles = ["actor_train", "actor_infer"]
    if cfg.needs_reference:
        roles.append("reference")
    if cfg.critic is not None:
        roles.append("critic")
    return roles


def _pg_name(cfg: RunConfig) -> str:
    return f"reroll-{cfg.name}-pool"


class ResourceManager:
    """Reserves the pool as one named Ray placement group (workers find it by name).

    Without ``placement.devices`` it reserves nothing: each worker asks Ray for its role's
    ``num_gpus_per_worker`` / ``num_cpus_per_worker`` (the local backend ignores resources).
    ``cfg`` is the run config with ``placement.device_type`` resolved: give it to the workers.
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.pg = None
        pool = cfg.placement.devices
        self.device_type = _resolve_device_type(cfg)
        placement = cfg.placement.model_copy(update={"device_type": self.device_type})
        self.cfg = cfg.model_copy(update={"placement": placement})
        self.map = device_map(cfg, run_roles(cfg), self.device_type) if pool else None
        if self.map is None or cfg.runtime.backend == "local":
            return
        if any(k > 1 for k in self.map.span.values()):
            raise UserError(
                "placement: an engine rank spanning several pool devices (rollout.vllm.tensor_parallel_size "
                "> 1 with placement.devices) is planned by `reroll plan` but not started by this version: "
                "leave placement.devices unset and give roles.actor_infer.num_gpus_per_worker instead"
            )
        import ray
        from ray.util.placement_group import placement_group

        have = ray.cluster_resources()
        kind = "GPU" if self.device_type == "cuda" else "CPU"
        per = 1.0 if kind == "GPU" else cfg.placement.cpus_per_device
        if have.get(kind, 0) < pool * per:
            raise UserError(
                f"placement: the pool needs {pool * per:g} {kind} ({pool} devices) but the Ray cluster has "
                f"{have.get(kind, 0):g}:\n{self.map.table()}\n"
                "fix: lower placement.devices and the roles' devices/world_size to fit, or join a bigger "
                "cluster (runtime.ray_address)"
            )
        bundle = {"GPU": 1.0, "CPU": cfg.placement.cpus_per_device} if kind == "GPU" else {"CPU": per}
        self.pg = placement_group([dict(bundle) for _ in range(pool)], strategy="PACK", name=_pg_name(cfg))
        if not self.pg.wait(timeout_seconds=60):
            raise UserError(
                f"placement: Ray could not reserve {pool} x {bundle} within 60 s (other jobs hold the "
                f"resources?):\n{self.map.table()}"
            )
        log.info("placement (%s):\n%s", self.device_type, self.map.table())

    def shutdown(self) -> None:
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None


def actor_options(cfg: RunConfig, role: str, rank: int) -> dict[str, Any]:
    """Ray actor options for ``role``'s rank ``rank``: its share of its pool device, or its role's
    ``num_cpus/num_gpus_per_worker`` when it is not on the pool."""
    rc = getattr(cfg.roles, role)
    if not cfg.placement.devices or role not in placed_roles(cfg, [role]):
        return {"num_cpus": rc.num_cpus_per_worker, "num_gpus": rc.num_gpus_per_worker}
    from ray.util import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    roles = run_roles(cfg)
    if role not in roles:
        roles.append(role)
    dmap = device_map(cfg, roles, cfg.placement.device_type)
    device = dmap.ranks[role][rank]
    share = len(dmap.workers_on(device))
    pg = get_placement_group(_pg_name(cfg))
    return {
        "num_cpus": cfg.placement.cpus_per_device / share,
        "num_gpus": 1.0 / share if cfg.placement.device_type == "cuda" else 0.0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=device
        ),
    }


def _resolve_device_type(cfg: RunConfig) -> str:
    kind = cfg.placement.device_type
    if kind != "auto":
        return kind
    if cfg.runtime.backend == "ray":
        import ray

        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Colocation:
    """Takes turns on shared devices: before a phase, offload the resident roles that share a device
    with the roles the phase uses, and reload those roles if they were offloaded.

    ``groups`` maps role name to its worker group (which has ``offload()`` and ``reload()``). With
    nothing colocated, or offloading off, ``use`` does nothing.
    """

    def __init__(self, groups: dict[str, Any], device_map: DeviceMap | None, enabled: bool) -> None:
        self.groups = {k: g for k, g in groups.items() if g is not None}
        self.map, self.enabled = device_map, enabled and device_map is not None
        self.offloaded: set[str] = set()
        self.seconds = {"offload": 0.0, "reload": 0.0}

    def use(self, *roles: str) -> None:
        if not self.enabled:
            return
        evict = [
            other
            for other in self.groups
            if other not in roles
            and other not in self.offloaded
            and any(self.map.colocated(other, r) for r in roles)
        ]
        start = time.perf_counter()
        for other in evict:
            self.groups[other].offload()
            self.offloaded.add(other)
        mid = time.perf_counter()
        for role in roles:
            if role in self.offloaded:
                self.groups[role].reload()
                self.offloaded.discard(role)
        self.seconds["offload"] += mid - start
        self.seconds["reload"] += time.perf_counter() - mid

    def pop_seconds(self) -> dict[str, float]:
        """``timing/offload`` and ``timing/reload`` since the last call (only when enabled)."""
        if not self.enabled:
            return {}
        out = {f"timing/{k}": v for k, v in self.seconds.items()}
        self.seconds = {"offload": 0.0, "reload": 0.0}
        return out
