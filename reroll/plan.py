"""``reroll plan``: where a config's roles go on N GPUs and how much memory each takes, before launching.

The estimate is arithmetic on the model's shape, not a measurement (``reroll.config.role_memory``,
which a rank's ``model.gradient_checkpointing: auto`` reads too): weights, gradients and AdamW
state per training rank after sharding (fsdp2 / deepspeed / megatron), activations of one micro-batch
(with each training role's count of checkpointed layers) and the logits at its response positions,
or a forward-only pass's at the size the run takes where larger (``reroll.config.memory``), the
engine's weights and KV cache, and the reference's weights; and each engine rank's share of its GPU
against what its start needs (``role_memory.engine_share``: a share too small is refused, as
``reroll validate`` refuses it). Colocated roles that offload between phases need the largest of them on a GPU; without offloading,
their sum, and host memory for what they park there (``_host_lines``). The shape comes from
``model.path``'s config.json where it is a local directory, else from a table of the model families
the examples use.
"""

from __future__ import annotations

from reroll.config.engines import engine_spec
from reroll.config.memory import DTYPE_BYTES, Shape, forward_only_limits
from reroll.config.placement import (
    device_map,
    offload_between_phases,
    run_roles,
    trainer_strategy,
    weight_sync_transport,
)
from reroll.config.role_memory import (
    GIB,
    USABLE,
    RolePlan,
    at_engine_share,
    checkpoint_counts,
    engine_share,
    engine_share_problem,
    estimate,
    forward_sized,
    held,
    planned,
    with_checkpointing,
)
from reroll.config.schema import RunConfig
from reroll.config.startable import context_parallel_size, start_problems
from reroll.models.shape import model_shape


def _forward_only_lines(
    cfg: RunConfig, shape: Shape, seq: int, roles: list[str], *, resident: bool = False
) -> list[str]:
    """What ``forward_only_limits`` gives the run's forward-only passes, and why (none in SFT);
    ``resident``: ``forward_sized`` set their size, so that every role stays beside the engine."""
    if not any(r in roles for r in ("reference", "critic", "teacher")) and not cfg.trains_on_rollouts:
        return []  # no forward-only pass: nothing scores the policy's samples
    o = cfg.optim

    def size(every_position: bool) -> str:
        rows, tokens = forward_only_limits(cfg, shape, seq, every_position=every_position)
        return f"{tokens} tokens" if tokens else f"{rows} rows"

    if resident:
        why = (
            "optim.logprob_* unset: the most that lets every colocated role stay resident beside the "
            "engine, as a training micro-batch's memory would not"
        )
    elif o.logprob_micro_batch_size or o.logprob_max_tokens_per_micro_batch:
        why = "optim.logprob_*"
    elif not offload_between_phases(cfg, "cuda"):
        why = "as training's micro-batches: colocated roles that never offload keep each pass's memory"
    else:
        why = "optim.logprob_* unset: as many as hold a training micro-batch's memory"
    line = f"forward-only passes (reference, old log-probs, values) on GPUs: {size(False)} at a time ({why})"
    if "teacher" in roles and size(True) != size(False):
        line += f"; a teacher's, its head at every position: {size(True)}"
    return ["", line]


def plan(cfg: RunConfig, *, gpus: int, gpu_memory_gib: float, prompt_tokens: int = 512) -> tuple[str, bool]:
    """The printed plan and whether it fits ``gpus`` GPUs of ``gpu_memory_gib`` each."""
    shape = model_shape(cfg.model.path)
    refused = start_problems(cfg, "cuda")  # the check `reroll validate` and the run's start make
    pool = cfg.placement.devices or gpus
    share = engine_share_problem(
        planned(cfg, pool), shape, gpu_memory_gib=gpu_memory_gib, prompt_tokens=prompt_tokens
    )
    refused += [share] if share and "actor_infer" in run_roles(cfg, "cuda") else []
    chosen = trainer_strategy(cfg, "cuda")  # the plan is for GPUs
    shown = chosen if chosen == cfg.strategy.name else f"{chosen} (strategy.name {cfg.strategy.name})"
    cp = context_parallel_size(cfg, "actor_train")
    if cp > 1:
        shown += f", context parallel {cp} (each rank of actor_train and reference holds 1/{cp} of a row)"
    cfg = planned(cfg, pool)
    dmap = device_map(cfg, "cuda")
    counts = checkpoint_counts(cfg, shape, prompt_tokens=prompt_tokens, gpu_memory_gib=gpu_memory_gib)
    sized = forward_sized(
        cfg, shape, prompt_tokens=prompt_tokens, gpu_memory_gib=gpu_memory_gib, checkpointed=counts
    )
    resident_sized = sized is not cfg  # the forward-only passes kept to what lets every role stay
    cfg = sized
    estimated = estimate(cfg, shape, prompt_tokens=prompt_tokens, checkpointed=counts)
    plans = {p.role: p for p in at_engine_share(cfg, estimated, gpu_memory_gib)}
    offload = offload_between_phases(cfg, "cuda")
    lines = [
        f"model {cfg.model.path}: {shape.params / 1e9:.2f}B parameters, {cfg.model.dtype}, "
        f"strategy {shown}, engine {cfg.rollout.engine}",
        f"{pool} GPUs in the pool, {gpus} available, {gpu_memory_gib:g} GiB each; colocated roles "
        f"{'offload between phases' if offload else 'stay resident'}",
        "",
        "per role, per GPU at its peak:",
    ]
    lines += [f"  {p.role:<12} {p.ranks:>3} ranks  {p.gib:8.1f} GiB  ({p.parts})" for p in plans.values()]
    lines += _share_lines(cfg, shape, plans, gpu_memory_gib, prompt_tokens)
    lines += _checkpointing_lines(cfg, shape, counts, prompt_tokens)
    lines += _smaller_micro_batch_lines(cfg, shape, counts, prompt_tokens, gpu_memory_gib)
    lines += ["", "per GPU:"]
    fits = pool <= gpus
    worst = 0.0
    for d in range(pool):
        roles = sorted({r for r, _ in dmap.workers_on(d)})
        need = [plans[r].gib for r in roles]
        peak = (max(need) if offload else sum(need)) if need else 0.0
        worst = max(worst, peak)
        flag = "" if peak <= USABLE * gpu_memory_gib else "  <- does not fit"
        fits &= not flag
        lines.append(f"  gpu {d}: {peak:8.1f} GiB  {' '.join(roles) or '(unused)'}{flag}")
    lines += _phase_lines(cfg, dmap, plans, pool, offload, usable=USABLE * gpu_memory_gib)
    lines += _host_lines(dmap, plans, pool) if offload else []
    lines += _lora_base_lines(cfg, shape, plans)
    policy = with_checkpointing(cfg, counts["actor_train"]) if "actor_train" in counts else cfg
    seq = prompt_tokens + cfg.rollout.max_new_tokens
    lines += _forward_only_lines(policy, shape, seq, list(plans), resident=resident_sized)
    if pool > gpus:
        lines.append(f"\nthe pool needs {pool} GPUs but only {gpus} are available")
    verdict = "fits" if fits else "does NOT fit"
    lines.append(f"\n{verdict}: peak {worst:.1f} GiB on one GPU of {gpu_memory_gib:g} GiB (90% usable)")
    if refused:
        fits = False
        lines.append("\ncannot start: this version refuses the config (`reroll validate` says the same):")
        lines += [f"  {path}: {message}" for path, message in refused]
    if not fits and not refused:
        lines.append(
            "to fit: add GPUs (placement.devices, roles.<role>.devices), shard more (strategy.name=fsdp2 "
            "or megatron parallel sizes), set model.gradient_checkpointing=auto (torch, fsdp2) or true, lower "
            "optim.micro_batch_size or rollout.generate_batch_size, or train LoRA adapters (strategy.lora)"
        )
    return "\n".join(lines), fits


def _share_lines(
    cfg: RunConfig, shape: Shape, plans: dict[str, RolePlan], gpu_memory_gib: float, prompt_tokens: int
) -> list[str]:
    """Each engine rank's share of its GPU against what its start needs (``engine_share``), where the
    engine holds a fixed share."""
    s = engine_share(cfg, shape, gpu_memory_gib=gpu_memory_gib, prompt_tokens=prompt_tokens)
    if s is None or "actor_infer" not in plans:
        return []
    verdict = "holds it" if s.share_gib >= s.need_gib else f"too small: at least {s.least:g}"
    return [
        f"engine share, each rank: {s.share:g} = {s.share_gib:.2f} GiB against {s.need_gib:.2f} GiB to "
        f"start ({s.parts}): {verdict}"
    ]


def _checkpointing_lines(
    cfg: RunConfig, shape: Shape, counts: dict[str, int], prompt_tokens: int
) -> list[str]:
    """The decoder layers each training role checkpoints (``model.gradient_checkpointing``), where any."""
    if not any(counts.values()):
        return []
    why = ""
    if cfg.model.gradient_checkpointing == "auto":
        why = (
            f" (auto: the fewest first layers whose phase fits beside an engine kept awake, else alone, at "
            f"{prompt_tokens}-token prompts; a run "
            "chooses from its own)"
        )
    each = ", ".join(f"{role} {n} of {shape.layers}" for role, n in counts.items())
    return [f"activation checkpointing, first layers recomputed in backward{why}: {each}"]


def _smaller_micro_batch_lines(
    cfg: RunConfig, shape: Shape, counts: dict[str, int], prompt_tokens: int, gpu_memory_gib: float
) -> list[str]:
    """Where 'auto' recomputes half of actor_train's layers or more at ``optim.micro_batch_size`` rows, the
    counts it would choose at a half and a quarter of those rows (not below 8): a layer recomputed costs
    about a third of its forward again on every micro-batch, a smaller micro-batch only some matrix-product
    efficiency. Not where micro-batches are sized in tokens (``optim.max_tokens_per_micro_batch``)."""
    rows, n = cfg.optim.micro_batch_size, counts.get("actor_train", 0)
    if (
        cfg.model.gradient_checkpointing != "auto"
        or cfg.optim.max_tokens_per_micro_batch
        or 2 * n < shape.layers
    ):
        return []
    options = []
    for fewer in (rows // 2, rows // 4):
        if fewer < 8:
            break
        smaller = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"micro_batch_size": fewer})})
        m = checkpoint_counts(smaller, shape, prompt_tokens=prompt_tokens, gpu_memory_gib=gpu_memory_gib)
        if m.get("actor_train", n) < n:
            options.append(f"{fewer} rows: {m['actor_train']} of {shape.layers}")
    if not options:
        return []
    return [
        f"  fewer rows a training micro-batch recompute fewer layers (optim.micro_batch_size, now {rows}): "
        f"{'; '.join(options)} (3B on an H100 80GB, 2026-12-07: 16 rows and 7 layers trained in 4.46 s, "
        "64 rows and all 36 in 4.91 s: docs/benchmarks.md)"
    ]


# A step's phases in the order a step runs them, each with the pool role it calls (its peak is the
# phase's: the training role's covers its forward-only passes, old log-probs and values).
PHASES = (
    ("generate", "actor_infer"),
    ("teacher log-probs", "teacher"),
    ("reward model", "learned_reward"),
    ("reference log-probs", "reference"),
    ("values, critic step", "critic"),
    ("train, old log-probs", "actor_train"),
)


def _phase_lines(
    cfg: RunConfig, dmap, plans: dict[str, RolePlan], pool: int, offload: bool, *, usable: float
) -> list[str]:
    """Per GPU, per phase of a step: the phase's role at its peak, alone where colocated roles offload
    between phases, else beside every other role on the GPU (each at its own peak: their sum, as the
    per-GPU lines count it). Then the weight sync, which holds actor_train and the awake engine at once
    (``ipc``, ``collective``) or one after the other (``object_store``), each with two buckets in flight;
    an ``ipc`` sync whose two roles do not fit together (``usable`` GiB) goes through host memory
    instead (``Roles._both_fit``): that line says so, and is not counted against the fit."""

    def on(d: int) -> set[str]:
        return {r for r, _ in dmap.workers_on(d) if r in plans}

    rows = []
    for name, role in PHASES:
        if role in plans:
            rows.append((name, [held(plans, on(d), role, offload) for d in range(pool)], role))
    if "actor_train" in plans and "actor_infer" in plans:
        transport = weight_sync_transport(cfg, "cuda")
        bucket = 2 * cfg.rollout.weight_sync_bucket_mb / 1024
        syncing = {
            "actor_train": plans["actor_train"].parked_gib + bucket,
            "actor_infer": plans["actor_infer"].gib + bucket,
        }
        together = transport != "object_store"
        need = []
        for d in range(pool):
            parts = [syncing[r] for r in on(d) if r in syncing]
            rest = sum(plans[r].gib for r in on(d) - syncing.keys()) if not offload else 0.0
            need.append(((sum(parts) if together else max(parts, default=0.0)) if parts else 0.0) + rest)
        roles = "actor_train, actor_infer"
        if transport == "ipc" and max(need) > usable:
            roles += "; above 90% of a GPU: this sync goes through host memory as the trainer leaves"
        rows.append((f"weight sync ({transport})", need, roles))
    why = (
        "a phase holds its own roles"
        if offload
        else "colocated roles stay resident: every phase holds them all"
    )
    lines = ["", f"per GPU, per phase ({why}):"]
    width = max(len(name) for name, _, _ in rows) if rows else 0
    for name, need, roles in rows:
        lines.append(f"  {name:<{width}}  {_by_gpu(need)}  ({roles})")
    return lines if rows else []


def _by_gpu(need: list[float]) -> str:
    """``31.7 GiB on gpus 0-7`` or, where GPUs differ, each run of equal ones: ``16.7 GiB on gpus 0-3,
    0.0 GiB on gpus 4-7``."""
    runs: list[tuple[float, int, int]] = []
    for d, gib in enumerate(need):
        if runs and f"{runs[-1][0]:.1f}" == f"{gib:.1f}" and runs[-1][2] == d - 1:
            runs[-1] = (runs[-1][0], runs[-1][1], d)
        else:
            runs.append((gib, d, d))
    return ", ".join(
        f"{gib:.1f} GiB on gpu{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}" for gib, a, b in runs
    )


def _lora_base_lines(cfg: RunConfig, shape: Shape, plans: dict[str, RolePlan]) -> list[str]:
    """Host memory an engine that merges LoRA adapters into the checkpoint's base weights keeps for
    them from its start (``reroll.engines.lora.BaseWeights``): about the decoder layers' weights (the
    model less its embedding), once per engine rank."""
    spec = engine_spec(cfg.rollout.engine)
    if cfg.strategy.synced_adapters is None or "actor_infer" not in plans or not spec.lora_base_on_host:
        return []
    each = (shape.params - shape.vocab * shape.hidden) * DTYPE_BYTES[cfg.model.dtype] / GIB
    engines = plans["actor_infer"].ranks // spec.span(cfg.rollout)
    return [
        f"\nhost memory of actor_infer's LoRA base (the adapted layers' weights, read from the checkpoint "
        f"as each engine starts, merged with the adapters at every sync): about {each:.1f} GiB x {engines} "
        f"engine{'s' if engines > 1 else ''}"
    ]


def _host_lines(dmap, plans: dict[str, RolePlan], pool: int) -> list[str]:
    """Host memory the roles that share a GPU take while offloaded, summed over the pool: a trainer's
    weights and Adam state (page-locked buffers, reroll.strategies.host_parking.HostParking), a sleeping
    vLLM engine's weights at ``rollout.vllm.sleep_level`` 1. Where ``placement.offload`` is 'auto' a
    trainer that fits beside the engine keeps its state on the GPU: the sum is the most it can take."""
    parked: dict[str, float] = {}
    for d in range(pool):
        workers = dmap.workers_on(d)
        if len({role for role, _ in workers}) > 1:
            for role, _ in workers:
                parked[role] = parked.get(role, 0.0) + plans[role].parked_gib
    if not any(parked.values()):
        return []
    parts = ", ".join(f"{role} {gib:.1f}" for role, gib in parked.items() if gib)
    return [
        f"\nhost memory of the offloaded roles, pinned, at most: {sum(parked.values()):.1f} GiB ({parts})"
    ]
