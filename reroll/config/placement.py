"""The roles a run starts and where their ranks go: one registry (``run_roles``), checked and pure.

``run_roles(cfg)`` gives every role a run of ``cfg`` starts, with what it needs: world size, what it
holds (strategy or engine), its pool devices and whether it stays resident between phases. The run
(``reroll.pipelines.roles.Roles.start``), the device map, ``reroll plan``, ``reroll validate``, the
placement group, recovery and shutdown all read it, so what is planned is what starts.

The config names a pool of ``placement.devices`` devices (GPUs, or CPU slots on a CPU-only cluster)
and, per role, the pool devices its ranks use (``roles.<role>.devices``). Rank ``r`` of a role with
``n`` ranks on ``d`` devices sits on ``devices[r * d // n]``; an engine spanning ``k`` devices (tensor
parallel) takes ``k`` consecutive ones per rank; roles that share a device are colocated. Nothing here
touches Ray or a device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reroll.config.engines import engine_spec
from reroll.config.roles import ROLES

if TYPE_CHECKING:
    from reroll.config.run import RunConfig


@dataclass(frozen=True)
class RoleSpec:
    """One role of a run, as ``run_roles`` gives it."""

    name: str
    world_size: int
    holds: str  # "strategy" | "engine" | "workers" (reroll.config.roles.ROLES)
    backend: str  # its strategy ('auto' resolved where the device type is known), its engine, or "workers"
    copies: int = 1  # groups of these ranks (a teacher each, in distillation)
    devices: tuple[int, ...] | None = (
        None  # the pool device of each rank (the first of its span); None: off the pool
    )
    span: int = 1  # pool devices one rank takes (a tensor-parallel engine)
    resident: bool = (
        True  # stays on its devices between phases (not colocated, or colocated roles never offload)
    )
    trainable: bool = False

    @property
    def on_pool(self) -> bool:
        return self.devices is not None


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
    """Devices one rank of ``role`` takes: actor_infer's engine's span (its tensor-parallel size), else 1."""
    return engine_spec(cfg.rollout.engine).span(cfg.rollout) if role == "actor_infer" else 1


def role_devices(cfg: RunConfig, role: str) -> list[int]:
    """``roles.<role>.devices``, or by default the first ``world_size`` (x span) devices of the pool."""
    rc = getattr(cfg.roles, role)
    if rc.devices is not None:
        return list(rc.devices)
    return list(range(min(rc.world_size * rank_span(cfg, role), cfg.placement.devices or 1)))


def on_pool(cfg: RunConfig, role: str) -> bool:
    """Whether ``role``'s ranks take devices of the pool: a role that holds a model, or one given devices."""
    return bool(cfg.placement.devices) and (
        ROLES[role].on_pool or getattr(cfg.roles, role).devices is not None
    )


def role_device(cfg: RunConfig, role: str, device_type: str) -> str:
    """'cuda' or 'cpu' for ``role``'s workers when pool devices are ``device_type``: the pool's type for
    a role on the pool, else by its ``num_gpus_per_worker``."""
    if on_pool(cfg, role):
        return "cuda" if device_type == "cuda" else "cpu"
    return "cuda" if getattr(cfg.roles, role).num_gpus_per_worker > 0 else "cpu"


def trainer_strategy(cfg: RunConfig, device: str) -> str:
    """``strategy.name`` with 'auto' resolved for trainer ranks on ``device`` ('cuda' or 'cpu'): fsdp2
    where it shards something (actor_train has several GPU ranks) or the user set one of its options
    (``strategy.fsdp2``: CPU offload, mixed precision), and on any device with ``strategy.context_parallel``
    above 1 (only fsdp2 splits sequences); torch otherwise. One fsdp2 rank shards nothing
    and is slower: 1.5x the torch strategy's train and reference time on an H200 (0.5B shape,
    docs/benchmarks.md), about 1.4x on the tiny model on 2 CPU cores. The run resolves it once, in
    ``ResourceManager`` with the device actor_train's ranks get, and writes it to config.yaml;
    ``make_strategy`` applies the same rule to a config that did not pass there (tests, benchmarks)."""
    name = cfg.strategy.name
    if name != "auto":
        return name
    if cfg.strategy.context_parallel > 1:
        return "fsdp2"
    if device != "cuda":
        return "torch"
    sharded = cfg.roles.actor_train.world_size > 1
    return "fsdp2" if sharded or cfg.strategy.fsdp2.model_fields_set else "torch"


def _rank_devices(cfg: RunConfig, role: str) -> tuple[int, ...]:
    devs, n, k = role_devices(cfg, role), getattr(cfg.roles, role).world_size, rank_span(cfg, role)
    if k > 1:  # each rank takes k consecutive devices of its list (check_placement: exactly n * k of them)
        return tuple(devs[min(r * k, len(devs) - 1)] for r in range(n))
    return tuple(devs[r * len(devs) // n] for r in range(n))


def run_roles(
    cfg: RunConfig, device_type: str | None = None, *, generate_only: bool = False
) -> dict[str, RoleSpec]:
    """Every role a run of ``cfg`` starts (``generate_only``: a ``reroll generate`` run, which trains
    nothing), in ``ROLES`` order. ``device_type``: what a pool device is, where known (it resolves the
    strategy 'auto' and whether colocated roles offload); else ``placement.device_type``."""
    kind = device_type or cfg.placement.device_type
    names = cfg.started_roles(generate_only=generate_only)
    specs: dict[str, RoleSpec] = {}
    for name in ROLES:
        if name not in names:
            continue
        role, rc = ROLES[name], getattr(cfg.roles, name)
        if role.holds == "strategy":
            backend = (
                trainer_strategy(cfg, role_device(cfg, name, kind)) if kind != "auto" else cfg.strategy.name
            )
        elif name == "actor_infer":
            backend = cfg.rollout.engine
        else:
            backend = cfg.reward.judge.engine if name == "judge" else "workers"
        pooled = on_pool(cfg, name)
        specs[name] = RoleSpec(
            name,
            rc.world_size,
            role.holds,
            backend,
            copies=names[name],
            devices=_rank_devices(cfg, name) if pooled else None,
            span=rank_span(cfg, name),
            trainable=role.trainable,
        )
    return _with_residency(cfg, specs, kind)


def _with_residency(cfg: RunConfig, specs: dict[str, RoleSpec], device_type: str) -> dict[str, RoleSpec]:
    """The specs with ``resident`` false for the roles that take turns on a shared device."""
    if not offload_between_phases(cfg, device_type):
        return specs
    dmap = _map(cfg, specs, device_type)
    return {
        name: RoleSpec(
            **{**spec.__dict__, "resident": not any(dmap.colocated(name, o) for o in dmap.ranks if o != name)}
        )
        for name, spec in specs.items()
    }


def _map(cfg: RunConfig, specs: dict[str, RoleSpec], device_type: str) -> DeviceMap:
    ranks = {n: s.devices for n, s in specs.items() if s.devices is not None}
    span = {n: s.span for n, s in specs.items() if s.devices is not None and s.span > 1}
    return DeviceMap(device_type, cfg.placement.devices or 0, ranks, span)  # type: ignore[arg-type]


def device_map(cfg: RunConfig, device_type: str, *, generate_only: bool = False) -> DeviceMap:
    """Where each rank of the run's pool roles sits (``check_placement`` has vetted the config)."""
    return _map(cfg, run_roles(cfg, device_type, generate_only=generate_only), device_type)


def check_placement(cfg: RunConfig) -> list[tuple[str, str]]:
    """Config-level problems as ``(dotted path, message)``: devices outside the pool, uneven splits, an
    engine whose ranks do not each get their span of consecutive pool devices."""
    problems = []
    pool = cfg.placement.devices
    for role in type(cfg.roles).model_fields:
        rc = getattr(cfg.roles, role)
        if rc.devices is None:
            problems += _span_problems(cfg, role)
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
        if rank_span(cfg, role) > 1:
            problems += _span_problems(cfg, role)
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


def _span_problems(cfg: RunConfig, role: str) -> list[tuple[str, str]]:
    """A role whose ranks span ``k`` > 1 pool devices each (a tensor-parallel engine): its ``n`` ranks
    take ``n * k`` devices of the pool, each rank ``k`` consecutive ones (an engine's workers are
    numbered as its devices are), one engine per ``k`` devices."""
    k, rc, pool = rank_span(cfg, role), getattr(cfg.roles, role), cfg.placement.devices
    if k == 1 or not pool or not on_pool(cfg, role):
        return []
    key = engine_spec(cfg.rollout.engine).span_key or "the engine's span"
    need = rc.world_size * k
    if rc.devices is None:
        if need <= pool:
            return []
        return [
            (
                f"roles.{role}.world_size",
                f"{rc.world_size} engine ranks of {key}={k} devices each need {need} pool devices, but "
                f"placement.devices is {pool}: lower roles.{role}.world_size to {max(1, pool // k)} or "
                f"{key}, or raise placement.devices to {need}",
            )
        ]
    path = f"roles.{role}.devices"
    if len(rc.devices) != need:
        return [
            (
                path,
                f"each of the {rc.world_size} engine ranks takes {key}={k} devices: list exactly {need} "
                f"devices, not {len(rc.devices)}",
            )
        ]
    runs = [list(rc.devices[r * k : (r + 1) * k]) for r in range(rc.world_size)]
    broken = [run for run in runs if run != list(range(run[0], run[0] + k))]
    if broken:
        return [
            (
                path,
                f"engine rank {runs.index(broken[0])} would take devices {broken[0]}: each rank of {key}={k} "
                f"takes {k} consecutive pool devices (its workers on the first and the next), e.g. "
                f"{list(range(broken[0][0], broken[0][0] + k))}",
            )
        ]
    return []


def offload_between_phases(cfg: RunConfig, device_type: str) -> bool:
    """Whether colocated roles offload: ``placement.offload`` 'auto' means only on GPUs."""
    mode = cfg.placement.offload
    return mode == "always" or (mode == "auto" and device_type == "cuda")


# How far above its state a trainer's reserved GPU memory may measure when it is asked to give the GPU
# away (the allocator's segments that live tensors keep from being freed; the 3B row on an H100 measured
# more than 1.26x its 18.5 GB of weights and AdamW moments, since it moved): a state within this factor
# of the room beside the engines may have to leave the GPU, so its host buffers are prepared ahead.
PARKING_MARGIN = 1.5


def keeps_state(cfg: RunConfig, role: str, resident_bytes: int, total: int) -> bool:
    """Whether a rank of ``role`` asked to give its GPU away keeps its state there instead, holding
    ``resident_bytes`` (``placement.offload: auto`` with a vLLM engine, whose memory its share bounds):
    that many bytes for each trainer role on the GPU (``colocated_trainer_roles``) plus every engine's
    share (``colocated_engines``) stay under 90 % of the GPU's ``total`` bytes."""
    if cfg.placement.offload != "auto" or cfg.rollout.engine != "vllm":
        return False
    trainers, engines = colocated_trainer_roles(cfg, role), colocated_engines(cfg, role)
    need = resident_bytes * trainers + engines * cfg.rollout.vllm.gpu_memory_utilization * total
    return need <= 0.9 * total


def may_park(cfg: RunConfig, role: str, state_bytes: int, total: int, *, room: float = math.inf) -> bool:
    """Whether rank 0 of ``role``, on a GPU of ``total`` bytes and holding ``state_bytes`` there (its
    state, or what was measured where more), is likely to move its state to host memory at some
    eviction, so that its host buffers are worth preparing ahead (``Strategy.prepare_offload``):
    colocated roles offload (``offload_between_phases``), another role shares its GPU, and it would
    not keep its state there (``keeps_state``, and no more than ``room`` bytes: what the other roles'
    phases leave it, ``reroll.config.role_memory.room_beside_phases``) with ``PARKING_MARGIN`` times
    those bytes reserved. A
    run that would keep it pins nothing ahead; should it move after all, its first offload pins, as
    without preparation."""
    if not offload_between_phases(cfg, "cuda"):
        return False
    on = _beside_rank0(cfg, role)
    if on is None or not set(on) - {role}:
        return False
    held = int(state_bytes * PARKING_MARGIN)
    return not keeps_state(cfg, role, held, total) or held > room


def engine_may_stay(cfg: RunConfig, device_type: str) -> bool:
    """Whether a colocated engine may stay awake beside the trainers (``placement.offload: auto``, an
    engine whose memory a fixed share of the GPU bounds, on GPUs), where each row is a prompt and one
    response of at most ``rollout.max_new_tokens`` (``cfg.bounded_rows``): what bounds the trainers'
    peak (``scaled_peak``)."""
    return (
        cfg.placement.offload == "auto"
        and device_type == "cuda"
        and engine_spec(cfg.rollout.engine).memory_share(cfg.rollout) is not None
        and cfg.bounded_rows
    )


def scaled_peak(peak: int, rest: int, widest: int, longest: int) -> int:
    """A rank's peak memory at micro-batches of rows ``longest`` tokens long, from ``peak`` measured at
    micro-batches up to ``widest`` tokens wide: the part above what it keeps between phases (``rest``:
    weights, gradients, optimizer state) grows with the width; 0 where nothing was measured yet."""
    if widest <= 0 or peak <= 0:
        return 0
    return rest + int(max(peak - rest, 0) * max(1.0, longest / widest))


def engine_headroom(
    needs: list[tuple[int, int]],
    engine_share: float,
    total: int,
    *,
    resident: bool = False,
    engines: int = 1,
) -> int | None:
    """Bytes to spare (negative: short) when ``engines`` engines holding ``engine_share`` of a GPU's
    ``total`` bytes each stay beside trainer roles that need ``(peak, rest)`` bytes each: at most
    ``peak`` in their own phases (``scaled_peak``), ``rest`` while another role's phase runs (its state,
    the cache freed at eviction). One trainer role runs at a time, so the worst phase holds one role's
    peak and the others' rest; that, the engines' shares and 1 GiB per process for its CUDA context must
    stay under 90 % of the GPU. ``resident``: nobody is evicted, so every role keeps its peak (its
    allocator's cache) at once. ``None`` while a role has not measured its peak."""
    if not needs or min(peak for peak, _ in needs) <= 0:
        return None
    if resident:
        worst = sum(peak for peak, _ in needs)
    else:
        worst = max(peak - rest for peak, rest in needs) + sum(rest for _, rest in needs)
    contexts = (len(needs) + engines) * 2**30
    return int(0.9 * total - worst - engines * engine_share * total - contexts)


def cluster_problems(
    cfg: RunConfig, resources: dict[str, float], device_type: str, *, generate_only: bool = False
) -> list[tuple[str, str]]:
    """What the Ray cluster with ``resources`` (``ray.cluster_resources()``) cannot hold, as ``(dotted
    path, message)``: the device pool, and the GPUs and CPUs the roles off the pool ask for."""
    pool, problems = cfg.placement.devices, []
    specs = run_roles(cfg, device_type, generate_only=generate_only)
    need = {"GPU": 0.0, "CPU": 0.0}
    if pool:
        kind = "GPU" if device_type == "cuda" else "CPU"
        per = 1.0 if kind == "GPU" else cfg.placement.cpus_per_device
        if resources.get(kind, 0) < pool * per:
            table = _map(cfg, specs, device_type).table()
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
    off_pool = [s for s in specs.values() if not s.on_pool]
    asks = {
        kind: {s.name: s.copies * s.world_size * getattr(getattr(cfg.roles, s.name), attr) for s in off_pool}
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
    return problems + custom_resource_problems(cfg, resources, specs)


def bundle_resources(cfg: RunConfig, dmap: DeviceMap, device: int) -> dict[str, float]:
    """The custom Ray resources (``roles.<role>.resources``) pool device ``device``'s bundle asks for: per
    key, the most any role on that device asks."""
    out: dict[str, float] = {}
    for role, _ in dmap.workers_on(device):
        for key, value in getattr(cfg.roles, role).resources.items():
            out[key] = max(out.get(key, 0.0), value)
    return out


def custom_resource_problems(
    cfg: RunConfig, resources: dict[str, float], specs: dict[str, RoleSpec]
) -> list[tuple[str, str]]:
    """The custom resources the roles ``specs`` ask for (``roles.<role>.resources``) that the cluster lacks."""
    pool = cfg.placement.devices
    need: dict[str, float] = {}
    if pool:
        dmap = _map(cfg, specs, cfg.placement.device_type)
        for d in range(pool):
            for key, value in bundle_resources(cfg, dmap, d).items():
                need[key] = need.get(key, 0.0) + value
    for spec in specs.values():
        if spec.on_pool:
            continue
        for key, value in getattr(cfg.roles, spec.name).resources.items():
            need[key] = need.get(key, 0.0) + value * spec.world_size * spec.copies
    return [
        (
            "roles",
            f"the roles ask Ray for {value:g} of the custom resource {key!r} (roles.<role>.resources) but the "
            f"cluster has {resources.get(key, 0):g}: start nodes with `ray start --resources "
            f"'{{\"{key}\": N}}'`, or change roles.<role>.resources",
        )
        for key, value in need.items()
        if value > resources.get(key, 0) + 1e-9
    ]


def shares_device(cfg: RunConfig, role: str, device_type: str | None = None) -> bool:
    """Whether a rank of ``role`` shares a pool device with another role of the run."""
    if not cfg.placement.devices:
        return False
    dmap = device_map(cfg, device_type or cfg.placement.device_type)
    return any(dmap.colocated(role, other) for other in dmap.ranks if other != role)


def weight_sync_transport(cfg: RunConfig, device_type: str) -> str:
    """'ipc', 'collective' or 'object_store': ``rollout.weight_sync_transport`` with 'auto' resolved, on
    a pool of ``device_type`` devices.

    - ipc: every engine worker (each actor_infer rank's span of devices) sits on a pool device where an
      actor_train rank sits (``ipc_senders``), on Ray, with an engine whose spec ``opens_shared``. Each
      of those trainer ranks gathers the full weights and hands the worker on its device a handle to
      each bucket: CUDA IPC on GPUs, POSIX shared memory on CPUs. With ``rollout.async_steps`` too (the
      roles then share devices where nothing moves, ``placement.offload: never``): a sync first waits
      for the generations in flight.
    - collective: on GPUs, no actor_infer rank on a GPU any actor_train rank uses (an NCCL group cannot
      hold two members on one GPU, and both roles stay resident while the buffers stream) and an engine
      that receives in the worker's process (hf, or in-process vLLM).
    - object_store: everything else: no pool, the local backend, ``rollout.async_steps`` on devices of
      the engine's own (its loads queue behind the generations in flight, where a broadcast would hold
      the trainer until the engine is free), separate CPU devices ('collective' with gloo is for a CPU cluster of several
      nodes, or to test the GPU path)."""
    mode = cfg.rollout.weight_sync_transport
    if mode != "auto":
        return mode
    if not cfg.placement.devices or cfg.runtime.backend == "local":
        return "object_store"
    if not _ipc_problem(cfg, device_type):
        return "ipc"
    if cfg.rollout.async_steps or device_type != "cuda":
        return "object_store"
    if not engine_spec(cfg.rollout.engine).receives_in_worker(cfg.rollout):
        return "object_store"
    dmap = device_map(cfg, device_type)
    return "object_store" if dmap.colocated("actor_train", "actor_infer") else "collective"


def ipc_senders(cfg: RunConfig, device_type: str) -> dict[int, int]:
    """The 'ipc' transport's senders: for each pool device an engine worker sits on, the first
    actor_train rank on it, as ``{trainer rank: pool device}`` (devices without a trainer rank are left
    out: ``_ipc_problem`` refuses them)."""
    dmap = device_map(cfg, device_type)
    wanted, senders = dmap.covered("actor_infer"), {}
    for rank, device in enumerate(dmap.ranks["actor_train"]):
        if device in wanted and device not in senders.values():
            senders[rank] = device
    return senders


def _ipc_problem(cfg: RunConfig, device_type: str) -> str | None:
    """Why the 'ipc' transport cannot run with ``cfg`` (None: it can)."""
    if cfg.runtime.backend == "local":
        return "it hands buffers between worker processes: it needs runtime.backend=ray"
    if not cfg.placement.devices:
        return "it needs a device pool (placement.devices) with actor_infer beside actor_train"
    spec = engine_spec(cfg.rollout.engine)
    if not spec.opens_shared:
        return f"the {spec.name} engine cannot open a trainer's shared buffers: use 'object_store'"
    dmap = device_map(cfg, device_type)
    if "actor_train" not in dmap.ranks or "actor_infer" not in dmap.ranks:
        return "it needs actor_train and actor_infer on the pool"
    alone = sorted(dmap.covered("actor_infer") - dmap.covered("actor_train"))
    if alone:
        return (
            f"engine workers on pool devices {alone} have no actor_train rank beside them to hand them "
            f"the weights (train {sorted(dmap.covered('actor_train'))}, infer "
            f"{sorted(dmap.covered('actor_infer'))}): place actor_infer on actor_train's devices, or use "
            "'auto'"
        )
    return None


def check_weight_sync(cfg: RunConfig, device_type: str) -> list[tuple[str, str]]:
    """Problems of an explicit ``rollout.weight_sync_transport`` on a pool of ``device_type`` devices
    ('auto' while not yet resolved): 'ipc' needs every engine worker beside a trainer rank, on Ray;
    'collective' needs Ray workers, and on GPUs (or with ``placement.offload: always``) actor_infer off
    actor_train's devices."""
    mode, path = cfg.rollout.weight_sync_transport, "rollout.weight_sync_transport"
    if mode == "ipc":
        why = None if check_placement(cfg) else _ipc_problem(cfg, device_type)
        return [(path, f"'ipc': {why}")] if why else []
    if mode != "collective":
        return []
    if cfg.runtime.backend == "local":
        return [(path, "'collective' broadcasts between worker processes: it needs runtime.backend=ray")]
    shared_ok = device_type != "cuda" and cfg.placement.offload != "always"
    if not cfg.placement.devices or shared_ok or check_placement(cfg):
        return []
    dmap = device_map(cfg, device_type)
    if not dmap.colocated("actor_train", "actor_infer"):
        return []
    return [
        (
            path,
            f"'collective' needs actor_infer on devices no actor_train rank uses (train "
            f"{sorted(dmap.covered('actor_train'))}, infer {sorted(dmap.covered('actor_infer'))}): both stay "
            "resident while the weights stream, and NCCL cannot hold two members on one GPU. Set "
            "roles.actor_infer.devices apart, or use 'auto' ('ipc' on the trainers' devices)",
        )
    ]


def colocated_trainer_roles(cfg: RunConfig, role: str) -> int:
    """How many roles that hold a training strategy (actor_train, reference, critic, teacher,
    learned_reward) share a device
    with rank 0 of ``role``, ``role`` included (1 without a pool)."""
    on = _beside_rank0(cfg, role)
    return 1 if on is None else len({r for r in on if r != "actor_infer"})


def colocated_engines(cfg: RunConfig, role: str) -> int:
    """How many actor_infer ranks (engines, each taking ``gpu_memory_utilization`` of the GPU) share a
    device with rank 0 of ``role`` (1 without a pool)."""
    on = _beside_rank0(cfg, role)
    return 1 if on is None else on.count("actor_infer")


def roles_beside(cfg: RunConfig, role: str) -> set[str]:
    """The other roles with a rank on the device of ``role``'s rank 0 (none without a pool)."""
    return set(_beside_rank0(cfg, role) or []) - {role}


def _beside_rank0(cfg: RunConfig, role: str) -> list[str] | None:
    """The role of every rank on the device of ``role``'s rank 0 (None without a pool)."""
    if not cfg.placement.devices:
        return None
    dmap = device_map(cfg, cfg.placement.device_type)
    return [r for r, _ in dmap.workers_on(dmap.ranks[role][0])] if role in dmap.ranks else None


def rollout_source_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What the rollout source's options (async, partial rollouts, over-sampling, tail batching) cannot
    run with, as ``(dotted path, message)``, every one found: pipelines without the rollout source
    (``cfg.rollout_source``) take none of them, and each has its own needs."""
    r = cfg.rollout
    if not cfg.rollout_source:
        return [
            (f"rollout.{key}", f"is an option of the rollout source, which pipeline {cfg.pipeline!r} does not "
             f"generate through ({cfg.no_rollout_source}; rlvr and on-policy distill do): remove rollout.{key}")
            for key in ("async_steps", "max_staleness", "partial_rollouts", "oversample", "tail_threshold")
            if key in r.changed_fields()
        ]  # fmt: skip
    problems = tail_problems(cfg) + streaming_problems(cfg)
    if not r.async_steps:
        if r.max_staleness is not None:
            problems.append(("rollout.max_staleness", "bounds the staleness of async samples, but "
                             "rollout.async_steps is 0 (every sample is fresh): remove max_staleness, or set "
                             "async_steps"))  # fmt: skip
        return problems
    if r.max_staleness is not None and r.max_staleness < r.async_steps:
        problems.append(
            (
                "rollout.max_staleness",
                f"({r.max_staleness}) is below rollout.async_steps ({r.async_steps}), the staleness every "
                f"async sample has: every batch would be generated again. Set max_staleness to at least "
                f"{r.async_steps}, or lower async_steps",
            )
        )
    if cfg.placement.devices:
        dmap = device_map(cfg, cfg.placement.device_type)
        shared = [o for o in dmap.ranks if o != "actor_infer" and dmap.colocated("actor_infer", o)]
        if shared and cfg.placement.offload != "never":
            problems.append(
                (
                    "roles.actor_infer.devices",
                    f"rollout.async_steps={r.async_steps} generates while {', '.join(shared)} compute(s), but "
                    f"actor_infer shares pool devices with {', '.join(shared)}, so they would take turns "
                    f"(colocated, placement.offload {cfg.placement.offload!r}):\n{dmap.table()}\nfix: give "
                    f"actor_infer devices of its own (e.g. placement.devices={_devices_needed(cfg)} with "
                    f"roles.actor_infer.devices set to the last), or set placement.offload to 'never' (every "
                    f"role stays on the device, so the engine generates the next batch beside the trainers: "
                    f"`reroll plan` says whether they fit), or set rollout.async_steps to 0",
                )
            )
    elif 0 < cfg.roles.actor_infer.num_gpus_per_worker < 1:
        problems.append(
            (
                "roles.actor_infer.num_gpus_per_worker",
                f"({cfg.roles.actor_infer.num_gpus_per_worker}) is a fraction of a GPU, which another role "
                "may share, so generation would not overlap training: with rollout.async_steps give "
                "actor_infer whole GPUs (or a placement pool with devices of its own)",
            )
        )
    return problems


def _devices_needed(cfg: RunConfig) -> int:
    """A pool big enough for actor_infer's ranks beside the others' (a suggestion in an error)."""
    infer = cfg.roles.actor_infer.world_size * rank_span(cfg, "actor_infer")
    others = max(s.world_size for s in run_roles(cfg).values() if s.on_pool and s.name != "actor_infer")
    return others + infer


def tail_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What ``rollout.tail_threshold`` (tail batching) cannot run with."""
    r, path = cfg.rollout, "rollout.tail_threshold"
    if r.tail_threshold is None:
        if "tail_share" in r.changed_fields():
            return [
                ("rollout.tail_share", "is set, but tail batching is off: set rollout.tail_threshold too")
            ]
        return []
    problems = []
    if r.tail_threshold >= r.max_new_tokens:
        problems.append(
            (path, f"({r.tail_threshold}) must be below rollout.max_new_tokens ({r.max_new_tokens}), or no "
             f"response is ever set aside: e.g. {max(1, r.max_new_tokens // 2)}")
        )  # fmt: skip
    others = {"rollout.async_steps": r.async_steps > 0, "algorithm.dynamic_sampling": cfg.dynamic_sampling}
    for what, on in others.items():
        if on:
            problems.append((path, f"tail batching does not run with {what} yet: turn one of them off"))
    return problems


def streaming_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What ``rollout.partial_rollouts`` and ``rollout.oversample`` cannot run with."""
    r, problems = cfg.rollout, []
    if r.partial_rollouts:
        path = "rollout.partial_rollouts"
        if not r.async_steps:
            problems.append((path, "continues the generations in flight at a weight update, but with "
                             "rollout.async_steps 0 none is in flight then: set async_steps >= 1, or remove "
                             "partial_rollouts"))  # fmt: skip
        if cfg.runtime.backend == "local":
            problems.append((path, "runtime.backend 'local' runs each generation to its end when it is "
                             "submitted, so nothing is ever in flight to interrupt: use runtime.backend=ray"))  # fmt: skip
        if cfg.strategy.synced_adapters is not None:
            problems.append((path, "adapter weight sync waits for the generations in flight: set "
                             "strategy.lora.sync=merged, or remove partial_rollouts"))  # fmt: skip
        if r.weight_sync_transport not in ("auto", "object_store"):
            problems.append((path, f"weight_sync_transport {r.weight_sync_transport!r} waits for the "
                             "generations in flight: use 'auto' or 'object_store'"))  # fmt: skip
        elif weight_sync_transport(cfg, cfg.placement.device_type) != "object_store":
            problems.append((path, "weight_sync_transport 'auto' is 'ipc' here (actor_infer beside "
                             "actor_train), which waits for the generations in flight: set "
                             "rollout.weight_sync_transport=object_store, or remove partial_rollouts"))  # fmt: skip
    if r.oversample is not None:
        path = "rollout.oversample"
        others = {
            # with async the engines interrupt the groups over the quota themselves, and an update's
            # interrupt would cut the kept ones
            "rollout.partial_rollouts": r.partial_rollouts,
            "rollout.tail_threshold": r.tail_threshold is not None,
        }
        for what, on in others.items():
            if on:
                problems.append((path, f"streaming with over-sampling does not run with {what} yet: "
                                 "turn one of them off"))  # fmt: skip
    for key, on in (
        ("rollout.partial_rollouts", r.partial_rollouts),
        ("rollout.oversample", r.oversample is not None),
    ):
        if on and not engine_spec(r.engine).streams:
            problems.append((key, f"needs an engine that streams and can be interrupted (hf, vllm), not "
                             f"{r.engine!r}: set rollout.engine=vllm or hf"))  # fmt: skip
    return problems
