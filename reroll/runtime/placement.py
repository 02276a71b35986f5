"""Placement: which devices each role's ranks use, and the Ray placement group that holds them.

The config names a pool of ``placement.devices`` devices (GPUs, or CPU slots on a CPU-only cluster)
and, per role, the pool devices its ranks use (``roles.<role>.devices``). Rank ``r`` of a role with
``n`` ranks on ``d`` devices sits on ``devices[r * d // n]``. Roles that share a device are colocated:
Ray gives each worker on a device an equal fraction of it, and the pipeline offloads the roles a phase
does not use (``Colocation``). The map itself is pure and lives with the config
(``reroll.config.placement``), so ``reroll validate`` and ``reroll plan`` show the same map the run uses.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reroll.config.engines import resolve_engine
from reroll.config.placement import (
    DeviceMap,
    RoleSpec,
    check_weight_sync,
    cluster_problems,
    device_map,
    on_pool,
    role_device,
    run_roles,
    trainer_strategy,
)
from reroll.config.replacement import lost_node_message, pool_bundle, resume_hint, run_demands, unplaced
from reroll.config.roles import ROLES
from reroll.config.startable import start_problems
from reroll.errors import UserError

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

log = logging.getLogger(__name__)


def worker_device(cfg: RunConfig, role: str) -> str:
    """'cuda' or 'cpu' for ``role``'s workers, in a config whose ``placement.device_type`` the
    ``ResourceManager`` has resolved (``auto`` counts as cpu here)."""
    return role_device(cfg, role, cfg.placement.device_type)


def _pg_name(cfg: RunConfig) -> str:
    return f"reroll-{cfg.name}-pool"


# placement group name -> the roles its ResourceManager started (``run_roles``): a ``reroll generate``
# run starts no actor_train, so its engine takes its devices alone
_STARTED: dict[str, dict[str, RoleSpec]] = {}


class ResourceManager:
    """Reserves the pool as one named Ray placement group (workers find it by name).

    Without ``placement.devices`` it reserves nothing: each worker asks Ray for its role's
    ``num_gpus_per_worker`` / ``num_cpus_per_worker`` (the local backend ignores resources).
    ``cfg`` is the run config with ``placement.device_type`` and ``strategy.name`` resolved: give it to
    the workers.
    """

    def __init__(self, cfg: RunConfig, *, generate_only: bool = False) -> None:
        self.pg = None
        self.nodes: set[str] = set()  # the Ray nodes alive when the run started
        self.bundle_nodes: dict[int, str] = {}  # pool device -> the node its bundle is on
        self.device_type = _resolve_device_type(cfg)
        cfg = self.cfg = resolved(cfg, self.device_type)
        pool = cfg.placement.devices
        self.specs = run_roles(self.cfg, self.device_type, generate_only=generate_only)
        _STARTED[_pg_name(cfg)] = self.specs  # what actor_options places (workers are spawned here)
        self.map = device_map(cfg, self.device_type, generate_only=generate_only) if pool else None
        refused = start_problems(cfg, self.device_type)  # what validate and plan refuse, device now known
        if refused:
            raise UserError("\n".join(f"{path}: {message}" for path, message in refused))
        if cfg.runtime.backend == "local":
            return
        import ray

        have = ray.cluster_resources()
        problems = cluster_problems(cfg, have, self.device_type, generate_only=generate_only)
        problems += check_weight_sync(cfg, self.device_type)  # the device type is known only now
        if problems:
            raise UserError("\n".join(f"{path}: {message}" for path, message in problems))
        self.nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}  # what a lost node is missed from
        if self.map is None:
            return
        from ray.util.placement_group import placement_group

        bundles = [pool_bundle(cfg, self.map, d) for d in range(pool)]
        self.pg = placement_group(bundles, strategy="PACK", name=_pg_name(cfg))
        if not self.pg.wait(timeout_seconds=60):
            raise UserError(
                f"placement: Ray could not reserve {bundles} within 60 s (other jobs hold the "
                f"resources?):\n{self.map.table()}"
            )
        self.bundle_nodes = self._bundle_nodes()
        log.info("placement (%s):\n%s", self.device_type, self.map.table())

    def _bundle_nodes(self) -> dict[int, str]:
        from ray.util import placement_group_table

        return dict(placement_group_table(self.pg)["bundles_to_node_id"])

    def check_nodes(self, step: int, checkpoint: Path | None) -> set[str]:
        """After a worker died at ``step``: if Ray nodes the run started on are gone, whether the run
        still fits the nodes left (``unplaced``). It does: wait until Ray has placed the pool's bundles
        of the lost nodes again (its GCS does that by itself), so that the restarted workers start there,
        and return the roles with ranks on those bundles (all dead: the run restarts them at once). It
        does not: a ``UserError`` naming what no longer fits and the fix (resume from ``checkpoint``
        later, or on fewer ranks). Ray's nodes are asked each time: a run that lost none pays one call."""
        if self.cfg.runtime.backend == "local":
            return set()
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive")]
        lost = self.nodes - {n["NodeID"] for n in alive}
        if not lost:
            return set()
        nodes = [n.get("Resources", {}) for n in alive]
        missing = unplaced(run_demands(self.cfg, self.specs, self.map), nodes)
        if missing:
            raise UserError(lost_node_message(missing, nodes, len(lost), step, checkpoint))
        self.nodes -= lost
        log.warning(
            "placement: %d Ray node(s) died at step %d; the run fits the %d left", len(lost), step, len(alive)
        )
        if self.pg is not None and not self.pg.wait(timeout_seconds=120):
            raise UserError(
                f"placement: {len(lost)} Ray node(s) died at step {step}; the nodes left have room for the "
                "pool's bundles, but Ray did not place them again within 120 s (other jobs took the room?):"
                f"\n{self.map.table() if self.map else ''}\nfix: {resume_hint(checkpoint)}"
            )
        if self.map is None:
            return set()
        moved = [d for d, node in self.bundle_nodes.items() if node in lost]
        self.bundle_nodes = self._bundle_nodes()
        return {role for d in moved for role, _ in self.map.workers_on(d)}

    def shutdown(self) -> None:
        _STARTED.pop(_pg_name(self.cfg), None)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None


def resolved(cfg: RunConfig, device_type: str) -> RunConfig:
    """``cfg`` as the run's workers get it and config.yaml records it, pool devices being ``device_type``:
    the device type; on a GPU machine with no pool where no role asks for GPUs itself, one GPU that the
    model roles share; ``strategy.name`` 'auto' and ``rollout.engine`` 'auto' chosen for the devices the
    roles got; each role's torch threads."""
    placement = cfg.placement.model_copy(update={"device_type": device_type})
    asks = any(getattr(cfg.roles, role).num_gpus_per_worker > 0 for role in ROLES)
    if placement.devices is None and device_type == "cuda" and not asks:
        placement = placement.model_copy(update={"devices": 1})
        log.info("placement: no pool set and no role asks for GPUs on a GPU machine: the roles share GPU 0")
    cfg = cfg.model_copy(update={"placement": placement})
    name = trainer_strategy(cfg, worker_device(cfg, "actor_train"))
    engine = resolve_engine(cfg.rollout.engine, worker_device(cfg, "actor_infer"))
    cfg = cfg.model_copy(
        update={
            "strategy": cfg.strategy.model_copy(update={"name": name}),
            "rollout": cfg.rollout.model_copy(update={"engine": engine}),
        }
    )
    return with_threads(cfg)


def actor_options(cfg: RunConfig, role: str, rank: int) -> dict[str, Any]:
    """Ray actor options for ``role``'s rank ``rank``: its share of its pool device, or its role's
    ``num_cpus/num_gpus_per_worker`` when it is not on the pool; and its ``worker_threads`` as the
    process's ``OMP_NUM_THREADS``."""
    options = _resources(cfg, role, rank)
    env = options.pop("env_vars", {}) | _threads(worker_threads(cfg, role))
    return options | ({"runtime_env": {"env_vars": env}} if env else {})


def worker_threads(cfg: RunConfig, role: str) -> int | None:
    """The torch threads of a worker of ``role`` on Ray: ``roles.<role>.torch_threads`` when set; else,
    on CPU, its pool device's ``placement.cpus_per_device`` (at least 1), or without a pool the
    machine's cores over the role's ranks (roles take turns, a role's ranks run together); else None,
    Ray's default (the worker's ``num_cpus``, at least 1: what a GPU worker gets). Ray's default on
    CPU gave every role of the quickstart 1 thread of the 2 cores it takes turns on."""
    rc = getattr(cfg.roles, role)
    if rc.torch_threads is not None:
        return rc.torch_threads
    if not ROLES[role].on_pool or cfg.runtime.backend == "local" or worker_device(cfg, role) != "cpu":
        return None
    if on_pool(cfg, role):
        return max(1, int(cfg.placement.cpus_per_device))
    return max(1, (os.cpu_count() or 1) // rc.world_size)


def driver_threads(cfg: RunConfig) -> int | None:
    """The torch threads of the run's own process (the driver) while its roles run as Ray workers: 1.
    Its tensors are a batch's (advantages, metrics: milliseconds on one thread), and where other
    processes hold some of the cores (an engine generating beside the trainers, one step off-policy),
    each of its ops on many threads waited for the slowest: the advantages phase took 0.30 s a step
    on an H100 machine's 16 cores, 2026-12-07 (0.00 s in the synchronous row), and 0.25 s against
    0.003 s on one thread here with one other busy process. None with ``runtime.backend: local``,
    where the roles compute in this process."""
    return 1 if cfg.runtime.backend == "ray" else None


def configure_process(cfg: RunConfig, role: str) -> None:
    """Process-wide torch settings of a worker of ``role``: its CPU threads (``worker_threads``) and
    whether attention may use cuDNN (``model.cudnn_attention``; a flag torch reads at each call)."""
    import torch

    torch.set_num_threads(worker_threads(cfg, role) or torch.get_num_threads())
    torch.backends.cuda.enable_cudnn_sdp(cfg.model.cudnn_attention)


def with_threads(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the ``worker_threads`` of the run's model roles in ``roles.<role>.torch_threads``, so
    that the run's config.yaml records them."""
    roles = {}
    for role in run_roles(cfg):
        threads = worker_threads(cfg, role)
        if threads is not None:
            roles[role] = getattr(cfg.roles, role).model_copy(update={"torch_threads": threads})
    return cfg.model_copy(update={"roles": cfg.roles.model_copy(update=roles)})


def _threads(threads: int | None) -> dict[str, str]:
    """A worker's torch threads as its process's ``OMP_NUM_THREADS`` too. Ray sets that variable to the
    actor's CPU share (1 for a fraction), and every thread of the process other than the one that
    called ``torch.set_num_threads`` starts from it: vLLM's CPU attention planned a step for 1 thread
    and ran it on 2 ("Check failed: ... thread_num (1 vs. 2)")."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}


def _resources(cfg: RunConfig, role: str, rank: int) -> dict[str, Any]:
    rc = getattr(cfg.roles, role)
    if not on_pool(cfg, role):
        return {
            "num_cpus": rc.num_cpus_per_worker,
            "num_gpus": rc.num_gpus_per_worker,
            **({"resources": dict(rc.resources)} if rc.resources else {}),
        }
    from ray.util import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    specs = _STARTED.get(_pg_name(cfg)) or run_roles(cfg, cfg.placement.device_type)
    dmap = DeviceMap(
        cfg.placement.device_type,
        cfg.placement.devices or 0,
        {n: s.devices for n, s in specs.items() if s.devices is not None},
        {n: s.span for n, s in specs.items() if s.devices is not None and s.span > 1},
    )
    if role not in dmap.ranks:  # a role the run does not start (generate's actor_train)
        raise ValueError(f"{role} is not a role of this run: {sorted(specs)}")
    device, span = dmap.ranks[role][rank], dmap.span.get(role, 1)
    # a role of several groups (a teacher each, in distillation) takes a share per group
    share = sum(specs[r].copies for r, _ in dmap.workers_on(device))
    pg = get_placement_group(_pg_name(cfg))
    gpus = cfg.placement.device_type == "cuda"
    spanning = (
        spanned_gpus(pg, list(range(device, device + span)), 1.0 / share) if gpus and span > 1 else None
    )
    return {
        "num_cpus": cfg.placement.cpus_per_device / share,
        "num_gpus": 1.0 / share if gpus else 0.0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=device
        ),
        **({"env_vars": sees_gpus(spanning, role, rank)} if spanning else {}),
    }


def spanned_gpus(pg: Any, bundles: list[int], share: float) -> list[tuple[str, str]]:
    """``(node id, GPU id)`` of each pool device in ``bundles``, as a task holding ``share`` of it
    there sees them (``ray.get_gpu_ids``): the GPUs an engine rank spanning those devices must see.
    The rank's share of each device but its first is otherwise unclaimed (its workers are vLLM's own
    processes, not Ray's), so the tasks fit. NOT YET RUN ON GPUs: written for a multi-GPU machine."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=share)
    def where() -> tuple[str, str]:
        ids = ray.get_gpu_ids()
        return ray.get_runtime_context().get_node_id(), str(ids[0])

    refs = [
        where.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=b
            )
        ).remote()
        for b in bundles
    ]
    return ray.get(refs, timeout=120)


def sees_gpus(spanned: list[tuple[str, str]], role: str, rank: int) -> dict[str, str]:
    """The environment of a worker that must see the GPUs ``spanned`` (``spanned_gpus``), in order:
    Ray shows an actor only its own bundle's GPU unless told not to set ``CUDA_VISIBLE_DEVICES``
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``, as vLLM's own Ray executor does for its
    workers); vLLM's tensor-parallel worker ``i`` then takes ``cuda:i``, the GPU of the rank's
    ``i``-th pool device. Its devices must share a node (its workers are processes of it)."""
    nodes = {node for node, _ in spanned}
    if len(nodes) > 1:
        raise UserError(
            f"placement: {role}[{rank}] spans {len(spanned)} pool devices, which Ray placed on {len(nodes)} "
            "nodes; an engine's tensor-parallel workers are processes of one node: lower the engine's "
            "tensor parallel size to the GPUs of a node, or give placement.devices in whole nodes"
        )
    return {
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "CUDA_VISIBLE_DEVICES": ",".join(gpu for _, gpu in spanned),
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

    ``groups`` maps role name to its worker group (which has ``offload()`` and ``reload()``).
    ``offloads``: colocated roles offload between phases (``placement.offload``); with nothing colocated,
    or offloading off, ``use`` does nothing. Roles may be let stay (``let_stay``).
    """

    def __init__(self, groups: dict[str, Any], device_map: DeviceMap | None, offloads: bool) -> None:
        self.groups = {k: g for k, g in groups.items() if g is not None}
        self.map, self.offloads = device_map, offloads and device_map is not None
        self.offloaded: set[str] = set()
        self.seconds = {"offload": 0.0, "reload": 0.0}
        # bytes the trainer roles moved (their offload/reload return them) and the seconds of those calls
        self.moved = {"offload": [0, 0.0], "reload": [0, 0.0]}
        self.stays: Callable[[], set[str]] | None = None  # see ``let_stay``
        self.stayed: dict[str, bool] = {}  # whether each role asked about stayed at its last eviction

    def let_stay(self, stays: Callable[[], set[str]]) -> None:
        """Leave resident the roles ``stays()`` names when a phase would evict them (asked at every
        eviction, so the answer follows what was measured): a vLLM engine awake beside the trainers, or
        every role where all of them fit on the device at once."""
        self.stays = stays

    def use(self, *roles: str) -> None:
        if not self.offloads:
            return
        evict = [
            other
            for other in self.groups
            if other not in roles
            and other not in self.offloaded
            and any(self.map.colocated(other, r) for r in roles)
        ]
        start = time.perf_counter()
        if evict and self.stays is not None:
            kept = self.stays()
            self.stayed.update({role: role in kept for role in evict})
            evict = [role for role in evict if role not in kept]
        for other in evict:
            self._move("offload", other)
            self.offloaded.add(other)
        mid = time.perf_counter()
        for role in roles:
            if role in self.offloaded:
                self._move("reload", role)
                self.offloaded.discard(role)
        self.seconds["offload"] += mid - start
        self.seconds["reload"] += time.perf_counter() - mid

    def _move(self, way: str, role: str) -> None:
        """``role``'s offload or reload, with the bytes it says it moved (an engine's sleep says none)."""
        start = time.perf_counter()
        moved = getattr(self.groups[role], way)() or 0
        if moved:
            self.moved[way][0] += moved
            self.moved[way][1] += time.perf_counter() - start

    def pop_seconds(self) -> dict[str, float]:
        """``timing/offload`` and ``timing/reload`` since the last call (only where colocated roles offload)."""
        if not self.offloads:
            return {}
        out = {f"timing/{k}": v for k, v in self.seconds.items()}
        self.seconds = {"offload": 0.0, "reload": 0.0}
        return out

    def pop_moves(self) -> dict[str, float]:
        """``offload/bytes`` and ``reload/bytes``: what the trainer roles moved between host and device
        memory since the last call, and, where they moved any, ``offload/gb_per_s`` / ``reload/gb_per_s``
        over the seconds of the calls that did (only where colocated roles offload)."""
        if not self.offloads:
            return {}
        out: dict[str, float] = {}
        for way, (moved, seconds) in self.moved.items():
            out[f"{way}/bytes"] = float(moved)
            if moved and seconds > 0:
                out[f"{way}/gb_per_s"] = moved / seconds / 1e9
        self.moved = {"offload": [0, 0.0], "reload": [0, 0.0]}
        return out

    def metrics(self) -> dict[str, float]:
        """``placement/<role>_stayed``: whether a role ``let_stay`` was asked about stayed resident at its
        last eviction (1.0)."""
        return {f"placement/{role}_stayed": float(stayed) for role, stayed in self.stayed.items()}
