"""Whether a run still fits a Ray cluster that lost nodes: the run's demands (each pool device's bundle,
each worker of a role off the pool) packed onto the nodes left as Ray must place them, each whole on one
node. Pure: ``ResourceManager.check_nodes`` gives it the nodes Ray reports; tests give it a made-up
cluster."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reroll.config.placement import DeviceMap, RoleSpec, bundle_resources

if TYPE_CHECKING:
    from reroll.config.run import RunConfig

EPS = 1e-9


@dataclass(frozen=True)
class Demand:
    """What one pool device's bundle, or one off-pool worker, asks a single node for."""

    name: str  # 'pool device 0 (actor_train[0] actor_infer[0])', 'reward[1]'
    resources: dict[str, float]
    roles: tuple[str, ...]  # the roles whose ranks it holds (the fix names their world_size)


def pool_bundle(cfg: RunConfig, dmap: DeviceMap, device: int) -> dict[str, float]:
    """The Ray bundle that holds pool device ``device``: a GPU and ``placement.cpus_per_device`` CPUs, or
    ``cpus_per_device`` CPUs for a CPU slot; and the custom resources its roles ask for."""
    cpus = cfg.placement.cpus_per_device
    kind = {"GPU": 1.0, "CPU": cpus} if dmap.device_type == "cuda" else {"CPU": cpus}
    return kind | bundle_resources(cfg, dmap, device)


def run_demands(cfg: RunConfig, specs: dict[str, RoleSpec], dmap: DeviceMap | None) -> list[Demand]:
    """Every bundle of the pool (``dmap``; None: no pool) and every worker off it that the run of
    ``cfg`` with the roles ``specs`` holds on the cluster."""
    demands = []
    for device in range(dmap.num_devices) if dmap is not None else ():
        workers = dmap.workers_on(device)
        held = " ".join(f"{role}[{rank}]" for role, rank in workers) or "unused"
        roles = tuple(dict.fromkeys(role for role, _ in workers))
        demands.append(Demand(f"pool device {device} ({held})", pool_bundle(cfg, dmap, device), roles))
    for spec in specs.values():
        if spec.on_pool:
            continue
        rc = getattr(cfg.roles, spec.name)
        asks = {"CPU": rc.num_cpus_per_worker, "GPU": rc.num_gpus_per_worker, **rc.resources}
        for rank in range(spec.world_size * spec.copies):
            demands.append(Demand(f"{spec.name}[{rank}]", asks, (spec.name,)))
    return demands


def unplaced(demands: Sequence[Demand], nodes: Sequence[dict[str, float]]) -> list[Demand]:
    """The demands that find no room on ``nodes`` (each node's total resources), packed largest first
    onto the first node with room for the whole demand (first-fit decreasing: where this finds room,
    so does Ray, which may place a bundle on any node)."""
    room = [dict(node) for node in nodes]
    missing = []
    for demand in sorted(demands, key=_size, reverse=True):
        asks = {k: v for k, v in demand.resources.items() if v > 0}
        node = next((n for n in room if all(n.get(k, 0.0) + EPS >= v for k, v in asks.items())), None)
        if node is None:
            missing.append(demand)
            continue
        for k, v in asks.items():
            node[k] -= v
    return [d for d in demands if d in missing]  # in the run's order


def _size(demand: Demand) -> tuple[float, float, float]:
    r = demand.resources
    return (r.get("GPU", 0.0), r.get("CPU", 0.0), sum(v for k, v in r.items() if k not in ("GPU", "CPU")))


def lost_node_message(
    missing: Sequence[Demand],
    nodes: Sequence[dict[str, float]],
    lost: int,
    step: int,
    checkpoint: Path | None,
) -> str:
    """The error of a run that lost ``lost`` nodes at ``step`` and no longer fits the ``nodes`` left:
    what does not fit, what is left, and the fix (resume once the cluster is whole again, or smaller)."""
    asked = "\n".join(f"  {d.name}: {_resources(d.resources)}" for d in missing)
    left = "\n".join(f"  node {i}: {_resources(n)}" for i, n in enumerate(nodes)) or "  (none)"
    roles = sorted({role for d in missing for role in d.roles})
    sizes = " or ".join(f"roles.{role}.world_size" for role in roles)
    pool = " and placement.devices" if any(d.name.startswith("pool device") for d in missing) else ""
    return (
        f"placement: {lost} Ray node{'s' * (lost > 1)} died at step {step}, and the rest of the cluster no "
        f"longer fits the run; these no longer fit:\n{asked}\nthe nodes left have:\n{left}\nfix: once the "
        f"cluster has its nodes back, {resume_hint(checkpoint)}; or lower {sizes}{pool} to what is left (a "
        "sharded checkpoint resumes at another world size)"
    )


def resume_hint(checkpoint: Path | None) -> str:
    """How a run stopped by a lost node goes on later, from ``checkpoint`` (its latest) if any."""
    if checkpoint is None:
        return "no checkpoint was written yet: `reroll train CONFIG` starts it again"
    return f"`reroll train CONFIG --resume` continues from {checkpoint}"


def _resources(r: dict[str, float]) -> str:
    shown = {k: v for k, v in r.items() if v > 0 and not k.startswith(("node:", "memory", "object_store"))}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "nothing"
