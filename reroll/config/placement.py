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
    """``strategy.name`` with 'auto' resolved for trainer ranks on ``device`` ('cuda' or 'cpu'): fsdp2
    where it shards something (actor_train has several GPU ranks) or the user set one of its options
    (``strategy.fsdp2``: CPU offload, mixed precision); torch otherwise. One fsdp2 rank shards nothing
    and is slower: 1.5x the torch strategy's train and reference time on an H200 (0.5B shape,
    docs/benchmarks.md), about 1.4x on the tiny model on 2 CPU cores. The run resolves it once, in
    ``ResourceManager`` with the device actor_train's ranks get, and writes it to config.yaml;
    ``make_strategy`` applies the same rule to a config that did not pass there (tests, benchmarks)."""
    name = cfg.strategy.name
    if name != "auto":
        return name
    if device != "cuda":
        return "torch"
    sharded = cfg.roles.actor_train.world_size > 1
    return "fsdp2" if sharded or cfg.strategy.fsdp2.model_fields_set else "torch"


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


def engine_may_stay(cfg: RunConfig, device_type: str) -> bool:
    """Whether a colocated engine may stay awake beside the trainers (``placement.offload: auto``, a vLLM
    engine, whose memory its share bounds, on GPUs), where each row is a prompt and one response of at
    most ``rollout.max_new_tokens`` (rlvr, distill): what bounds the trainers' peak (``scaled_peak``)."""
    return (
        cfg.placement.offload == "auto"
        and device_type == "cuda"
        and cfg.rollout.engine == "vllm"
        and cfg.pipeline in ("rlvr", "distill")
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
    return problems + custom_resource_problems(cfg, resources)


def bundle_resources(cfg: RunConfig, dmap: DeviceMap, device: int) -> dict[str, float]:
    """The custom Ray resources (``roles.<role>.resources``) pool device ``device``'s bundle asks for: per
    key, the most any role on that device asks."""
    out: dict[str, float] = {}
    for role, _ in dmap.workers_on(device):
        for key, value in getattr(cfg.roles, role).resources.items():
            out[key] = max(out.get(key, 0.0), value)
    return out


def custom_resource_problems(cfg: RunConfig, resources: dict[str, float]) -> list[tuple[str, str]]:
    """The custom resources the roles ask for (``roles.<role>.resources``) that the cluster lacks."""
    pool = cfg.placement.devices
    need: dict[str, float] = {}
    if pool:
        dmap = device_map(cfg, run_roles(cfg), cfg.placement.device_type)
        for d in range(pool):
            for key, value in bundle_resources(cfg, dmap, d).items():
                need[key] = need.get(key, 0.0) + value
    for role in started_roles(cfg):
        if pool and role in placed_roles(cfg, [role]):
            continue
        rc = getattr(cfg.roles, role)
        for key, value in rc.resources.items():
            need[key] = need.get(key, 0.0) + value * rc.world_size
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
    """'cuda_ipc', 'collective' or 'object_store': ``rollout.weight_sync_transport`` with 'auto'
    resolved, on a pool of ``device_type`` devices.

    - cuda_ipc: every actor_infer rank on actor_train rank 0's GPU (it gathers the full weights) and an
      in-process engine (the tensors are opened in the worker's process).
    - collective: no actor_infer rank on a GPU any actor_train rank uses (an NCCL group cannot hold
      two members on one GPU, and both roles stay resident while the buffers stream) and an engine
      that receives in the worker's process (hf, or in-process vLLM).
    - object_store: everything else; always on CPU (the object store is host memory there too;
      'collective' with gloo is for a CPU cluster of several nodes, or to test the GPU path), and with
      ``rollout.async_steps`` (its loads queue behind the generations in flight, where a broadcast
      would hold the trainer until the engine is free)."""
    mode = cfg.rollout.weight_sync_transport
    if mode != "auto":
        return mode
    if device_type != "cuda" or not cfg.placement.devices:
        return "object_store"
    if cfg.rollout.async_steps:  # object-store loads queue behind the generations in flight
        return "object_store"
    in_worker = cfg.rollout.engine == "hf" or (cfg.rollout.engine == "vllm" and cfg.rollout.vllm.in_process)
    if not in_worker:
        return "object_store"
    dmap = device_map(cfg, run_roles(cfg), device_type)
    trainer0 = dmap.ranks["actor_train"][0]
    if all(d == trainer0 for d in dmap.ranks["actor_infer"]) and dmap.span.get("actor_infer", 1) == 1:
        return "cuda_ipc"
    return "object_store" if dmap.colocated("actor_train", "actor_infer") else "collective"


def check_weight_sync(cfg: RunConfig, device_type: str) -> list[tuple[str, str]]:
    """Problems of an explicit ``rollout.weight_sync_transport: collective`` on a pool of ``device_type``
    devices ('auto' while not yet resolved): it needs Ray workers, and on GPUs (or with
    ``placement.offload: always``) actor_infer off actor_train's devices."""
    if cfg.rollout.weight_sync_transport != "collective":
        return []
    path = "rollout.weight_sync_transport"
    if cfg.runtime.backend == "local":
        return [(path, "'collective' broadcasts between worker processes: it needs runtime.backend=ray")]
    shared_ok = device_type != "cuda" and cfg.placement.offload != "always"
    if not cfg.placement.devices or shared_ok or check_placement(cfg):
        return []
    dmap = device_map(cfg, run_roles(cfg), device_type)
    if not dmap.colocated("actor_train", "actor_infer"):
        return []
    return [
        (
            path,
            f"'collective' needs actor_infer on devices no actor_train rank uses (train "
            f"{sorted(dmap.covered('actor_train'))}, infer {sorted(dmap.covered('actor_infer'))}): both stay "
            "resident while the weights stream, and NCCL cannot hold two members on one GPU. Set "
            "roles.actor_infer.devices apart, or use 'auto' (cuda_ipc on the trainer's GPU)",
        )
    ]


def colocated_trainer_roles(cfg: RunConfig, role: str) -> int:
    """How many roles that hold a training strategy (actor_train, reference, critic, teacher,
    reward_model) share a device
    with rank 0 of ``role``, ``role`` included (1 without a pool)."""
    on = _beside_rank0(cfg, role)
    return 1 if on is None else len({r for r in on if r != "actor_infer"})


def colocated_engines(cfg: RunConfig, role: str) -> int:
    """How many actor_infer ranks (engines, each taking ``gpu_memory_utilization`` of the GPU) share a
    device with rank 0 of ``role`` (1 without a pool)."""
    on = _beside_rank0(cfg, role)
    return 1 if on is None else on.count("actor_infer")


def _beside_rank0(cfg: RunConfig, role: str) -> list[str] | None:
    """The role of every rank on the device of ``role``'s rank 0 (None without a pool)."""
    if not cfg.placement.devices:
        return None
    dmap = device_map(cfg, run_roles(cfg), cfg.placement.device_type)
    return [r for r, _ in dmap.workers_on(dmap.ranks[role][0])]


def async_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What ``rollout.async_steps`` cannot run with, as ``(dotted path, message)``: generation overlaps
    training only where actor_infer has devices of its own."""
    r = cfg.rollout
    problems = tail_problems(cfg) + streaming_problems(cfg)
    if not r.async_steps:
        if r.max_staleness is not None:
            return [("rollout.max_staleness", "bounds the staleness of async samples, but rollout.async_steps "
                     "is 0 (every sample is fresh): remove max_staleness, or set async_steps")]  # fmt: skip
        return problems
    if cfg.pipeline != "rlvr":
        problems.append(
            (
                "rollout.async_steps",
                f"runs in pipeline 'rlvr' only, not {cfg.pipeline!r}: set async_steps to 0",
            )
        )
    if r.max_staleness is not None and r.max_staleness < r.async_steps:
        problems.append(
            (
                "rollout.max_staleness",
                f"({r.max_staleness}) is below rollout.async_steps ({r.async_steps}), the staleness every "
                f"async sample has: every batch would be generated again. Set max_staleness to at least "
                f"{r.async_steps}, or lower async_steps",
            )
        )
    if r.weight_sync_transport == "cuda_ipc":
        problems.append(
            (
                "rollout.weight_sync_transport",
                "'cuda_ipc' shares actor_train's GPU memory with an engine on the same GPU, but "
                "rollout.async_steps needs actor_infer on devices of its own: use 'auto' or 'object_store'",
            )
        )
    if cfg.placement.devices:
        dmap = device_map(cfg, run_roles(cfg), cfg.placement.device_type)
        shared = [o for o in dmap.ranks if o != "actor_infer" and dmap.colocated("actor_infer", o)]
        if shared:
            problems.append(
                (
                    "roles.actor_infer.devices",
                    f"rollout.async_steps={r.async_steps} generates while {', '.join(shared)} compute(s), but "
                    f"actor_infer shares pool devices with {', '.join(shared)}, so they would take turns "
                    f"(colocated):\n{dmap.table()}\nfix: give actor_infer devices of its own (e.g. "
                    f"placement.devices={_devices_needed(cfg)} with roles.actor_infer.devices set to the "
                    f"last), or set rollout.async_steps to 0",
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
    others = max(getattr(cfg.roles, r).world_size for r in run_roles(cfg) if r != "actor_infer")
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
    others = {
        "rollout.async_steps": r.async_steps > 0,
        "algorithm.dynamic_sampling": cfg.algorithm.dynamic_sampling,
        f"pipeline {cfg.pipeline!r}": cfg.pipeline != "rlvr",
    }
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
        lora = cfg.strategy.lora
        if lora is not None and lora.sync == "adapters":
            problems.append((path, "adapter weight sync waits for the generations in flight: set "
                             "strategy.lora.sync=merged, or remove partial_rollouts"))  # fmt: skip
        if r.weight_sync_transport not in ("auto", "object_store"):
            problems.append((path, f"weight_sync_transport {r.weight_sync_transport!r} waits for the "
                             "generations in flight: use 'auto' or 'object_store'"))  # fmt: skip
    if r.oversample is not None:
        path = "rollout.oversample"
        others = {
            "rollout.async_steps": r.async_steps > 0,
            "rollout.tail_threshold": r.tail_threshold is not None,
            f"pipeline {cfg.pipeline!r}": cfg.pipeline != "rlvr",
        }
        for what, on in others.items():
            if on:
                problems.append((path, f"streaming with over-sampling does not run with {what} yet: "
                                 "turn one of them off"))  # fmt: skip
    for key, on in (
        ("rollout.partial_rollouts", r.partial_rollouts),
        ("rollout.oversample", r.oversample is not None),
    ):
        if on and r.engine not in ("hf", "vllm"):
            problems.append((key, f"needs an engine that streams and can be interrupted (hf, vllm), not "
                             f"{r.engine!r}: set rollout.engine=vllm or hf"))  # fmt: skip
    return problems
