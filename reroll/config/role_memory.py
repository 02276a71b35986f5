"""Per-GPU memory of a run's roles at their peaks, from the model's shape (``reroll.config.memory``'s
per-token arithmetic and the state's size): what ``reroll plan`` prints, and what a training role's
``model.gradient_checkpointing: auto`` chooses its count of checkpointed layers from
(``auto_checkpointed_layers``), so that both read the one estimate. No torch: the plan runs without it.

The estimate is arithmetic on the model's shape, not a measurement: weights, gradients and AdamW
state per training rank after sharding (fsdp2 / deepspeed / megatron), activations of one micro-batch
and the logits at its response positions, or a forward-only pass's at the size the run takes where
larger (``forward_only_limits``), the engine's weights and KV cache, and the reference's weights.
Every model role is sized with the policy's shape: a teacher or reward model of another size is
estimated as the policy's."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from reroll.config.engines import EngineSpec, engine_spec, resolve_engine
from reroll.config.memory import DTYPE_BYTES, Shape, checkpointed_layers, forward_only_limits, token_bytes
from reroll.config.placement import (
    colocated_engines,
    colocated_trainer_roles,
    device_map,
    engine_may_stay,
    offload_between_phases,
    roles_beside,
    run_roles,
    trainer_strategy,
)
from reroll.config.schema import RunConfig
from reroll.config.startable import context_parallel_size

GIB = 1024**3

# The share of a GPU the plan counts as usable (the rest: the CUDA context, the allocator's fragments).
USABLE = 0.9
# What a trainer's allocator reserves over the tensors it holds at its training peak: the runtime's
# residency check reads reserved memory, the estimate counts tensors. Measured: the 3B row's trainer on an
# H100 80GB (2026-12-07) held 44.8 GiB of tensors in 47.7 GiB reserved and asked for 4.6 GiB more that
# no cached block could take (reserved >= 52.3 GiB for 49.4 of tensors: 1.06).
RESERVED_OVER_ALLOCATED = 1.06

# fp32 chunks that per-token log-probs use at once on a GPU (about 4 of CHUNK_ELEMENTS_CUDA in
# reroll.algorithms.logprobs, not imported here: the plan needs no torch)
LOGPROB_WORKSPACE = 4 * 2**26 * 4


@dataclass
class RolePlan:
    role: str
    ranks: int
    gib: float  # per GPU, at this role's peak
    parts: str  # what the estimate is made of
    parked_gib: float = 0.0  # per rank, what it keeps in host memory while offloaded


def estimate(
    cfg: RunConfig, shape: Shape, *, prompt_tokens: int, checkpointed: dict[str, int] | None = None
) -> list[RolePlan]:
    """Per-GPU memory of each role of ``cfg`` that holds a model on the pool, at its own peak (the roles
    ``run_roles`` says the run starts, and only those). ``checkpointed``: each training role's count of
    checkpointed layers (``checkpoint_counts``); a role that does not train sizes its forward-only
    passes from actor_train's training micro-batch (``forward_only_limits``), so with its count."""
    seq = prompt_tokens + cfg.rollout.max_new_tokens
    plans = []
    for spec in run_roles(cfg, "cuda").values():
        if spec.name == "actor_infer":
            plans.append(_engine(cfg, shape, seq, spec.world_size))
        elif spec.holds == "strategy":
            own = cfg
            count = (checkpointed or {}).get(spec.name if spec.trainable else "actor_train")
            if count is not None:
                own = with_checkpointing(cfg, count)
            plans.append(
                _trainer(own, shape, seq, spec.name, spec.world_size * spec.copies, trainable=spec.trainable)
            )
    return plans


def with_checkpointing(cfg: RunConfig, layers: int) -> RunConfig:
    """``cfg`` with ``model.gradient_checkpointing`` set to a count of layers."""
    model = cfg.model.model_copy(update={"gradient_checkpointing": layers})
    return cfg.model_copy(update={"model": model})


def planned(cfg: RunConfig, pool: int | None) -> RunConfig:
    """``cfg`` as the plan sizes it: the pool of ``pool`` GPUs where ``placement.devices`` is unset
    (None: as set), the trainer strategy resolved for GPUs."""
    if pool is not None and cfg.placement.devices is None:
        cfg = cfg.model_copy(update={"placement": cfg.placement.model_copy(update={"devices": pool})})
    chosen = trainer_strategy(cfg, "cuda")
    return cfg.model_copy(update={"strategy": cfg.strategy.model_copy(update={"name": chosen})})


def held(plans: dict[str, RolePlan], here: set[str], role: str, offload: bool) -> float:
    """GiB on a GPU holding ``here`` while ``role``'s phase runs: the role alone where colocated roles
    offload between phases, else every role on the GPU (each at its own peak)."""
    if offload:
        return plans[role].gib if role in here else 0.0
    return sum(plans[r].gib for r in here)


def phase_peak(cfg: RunConfig, plans: dict[str, RolePlan], role: str) -> float:
    """GiB on the fullest GPU while ``role``'s phase runs (its own peak where it is off the pool)."""
    dmap, offload = device_map(cfg, "cuda"), offload_between_phases(cfg, "cuda")
    peaks = [
        held(plans, {r for r, _ in dmap.workers_on(d) if r in plans}, role, offload)
        for d in range(cfg.placement.devices or 0)
        if role in {r for r, _ in dmap.workers_on(d)}
    ]
    return max(peaks, default=plans[role].gib)


def auto_checkpointed_layers(
    cfg: RunConfig, shape: Shape, role: str, *, prompt_tokens: int, gpu_memory_gib: float
) -> int:
    """``model.gradient_checkpointing: auto``'s count for training role ``role``: the fewest first decoder
    layers whose checkpointing brings the GPU that ``role``'s phase fills most under ``USABLE`` of
    ``gpu_memory_gib`` less what the engines beside it need to stay awake through the phase
    (``awake_beside``), by ``estimate`` at rows of ``prompt_tokens`` plus ``rollout.max_new_tokens``
    (every training role evaluated at the same count). Where no count leaves the engines that room, the
    fewest under ``USABLE`` alone (the engines then sleep through the phase); where none does that
    either, ``shape.layers - 1``: the least the estimate can hold (``kept_activations``).

    Awake first: a layer recomputed costs about a third of its forward again, while an engine that must
    sleep costs a sleep, a wake and a weight sync through host memory every step (the 3B row on an H100
    80GB, 2026-12-07: 'auto' filled 90 % of the GPU with the trainer's phase, 24 of 36 layers
    checkpointed, and each step's sync then took 20 s of a 28 s step; train was 4.6 s). The trainer's
    peak is weighed as its allocator will reserve it (``RESERVED_OVER_ALLOCATED``): 31 layers by the
    tensors alone left the engine awake 2.4 GiB short of what the trainer reserved at step 2."""
    best = max(shape.layers - 1, 0)
    alone = []  # whether each count fits with the engines asleep, the fallback
    for n in range(best + 1):
        plans = {p.role: p for p in estimate(with_checkpointing(cfg, n), shape, prompt_tokens=prompt_tokens)}
        peak = phase_peak(cfg, plans, role)
        beside = awake_beside(cfg, plans, role, gpu_memory_gib)
        # beside an engine that stays, as the runtime's residency check will measure it: reserved
        weighed = peak * RESERVED_OVER_ALLOCATED if beside else peak
        if weighed <= USABLE * gpu_memory_gib - beside:
            return n
        alone.append(peak <= USABLE * gpu_memory_gib)
    return alone.index(True) if True in alone else best


def awake_beside(cfg: RunConfig, plans: dict[str, RolePlan], role: str, gpu_memory_gib: float) -> float:
    """GiB that ``role``'s phase must leave on its GPU for the engines there to stay awake through it,
    as the run's residency check counts (``reroll.config.placement.engine_headroom``): each engine's
    share, a CUDA context (1 GiB) for each process on the GPU and the state the other training roles
    there keep (what they would park: ``RolePlan.parked_gib``). 0 where no engine may stay awake
    (``engine_may_stay``: ``placement.offload`` 'auto', an engine of a fixed share) or none shares the
    GPU of ``role``'s rank 0."""
    if not _engine_stays_beside(cfg, role):
        return 0.0
    beside = roles_beside(cfg, role)
    others = sum(p.parked_gib for r, p in plans.items() if r in beside and r != "actor_infer")
    return _engines_gib(cfg, role, gpu_memory_gib) + _contexts(cfg, role) + others


def at_engine_share(cfg: RunConfig, plans: list[RolePlan], gpu_memory_gib: float) -> list[RolePlan]:
    """``plans`` with an engine of a fixed share of the GPU (vLLM's ``gpu_memory_utilization``) counted at
    what it takes on its GPU while awake: its share of ``gpu_memory_gib``, which its KV cache fills, or
    its need where that is more. ``estimate`` gives the need alone (weights and the KV cache of the
    batch), by which an engine of share 0.6 beside resident trainers read as 5 GiB on an 80 GiB GPU."""
    share = _gpu_engine(cfg).memory_share(cfg.rollout)
    if share is None:
        return plans
    taken = share * gpu_memory_gib
    return [
        replace(p, gib=taken, parts=f"{p.parts}; its share {share:g} of the GPU: {taken:.1f}")
        if p.role == "actor_infer" and taken > p.gib
        else p
        for p in plans
    ]


def _engine_stays_beside(cfg: RunConfig, role: str) -> bool:
    """Whether an engine of a fixed share of the GPU shares ``role``'s rank-0 GPU and may stay awake
    there (``engine_may_stay``)."""
    share = _gpu_engine(cfg).memory_share(cfg.rollout)
    return share is not None and "actor_infer" in roles_beside(cfg, role) and engine_may_stay(cfg, "cuda")


def _engines_gib(cfg: RunConfig, role: str, gpu_memory_gib: float) -> float:
    """GiB the engines on ``role``'s rank-0 GPU take at their shares (0 for engines of no fixed share)."""
    share = _gpu_engine(cfg).memory_share(cfg.rollout) or 0.0
    return colocated_engines(cfg, role) * share * gpu_memory_gib


def _contexts(cfg: RunConfig, role: str) -> int:
    """GiB of CUDA contexts on ``role``'s rank-0 GPU: 1 for each process there, an engine's included."""
    return colocated_trainer_roles(cfg, role) + colocated_engines(cfg, role)


def forward_sized(
    cfg: RunConfig,
    shape: Shape,
    *,
    prompt_tokens: int,
    gpu_memory_gib: float,
    checkpointed: dict[str, int] | None = None,
) -> RunConfig:
    """``cfg`` with its forward-only passes' size pinned (``optim.logprob_micro_batch_size``, or
    ``optim.logprob_max_tokens_per_micro_batch`` where training counts tokens) where the library sizes
    them (``forward_only_limits``) and that size alone would keep the colocated roles from all staying
    resident beside the engine: the largest size at which every training role's peak, each engine's
    share and a CUDA context per process fit in ``USABLE`` of the GPU at once (``resident_gib``, what the
    runtime's residency check asks of the measured peaks), no smaller than training's. Unchanged where
    the library's size already fits, where training's does not either (the roles move anyway, and fewer,
    larger passes are faster), where the engine may not stay awake (``engine_may_stay``), where a
    teacher's passes (their head at every position) are sized on their own, and where the user set one.

    Larger forward-only passes than that cost more than they save: on an H100 80GB (2026-12-06) the
    0.5B row with the library's size (428 rows) took 3.77 s a step against 3.63 s at training's 64
    rows in the same call, the reference's pass having pushed the trainers out of residency (resident
    headroom -14.6 GiB), so that each step offloaded and reloaded them."""
    o = cfg.optim
    if o.logprob_micro_batch_size or o.logprob_max_tokens_per_micro_batch:
        return cfg
    if not _engine_stays_beside(cfg, "actor_train") or "teacher" in run_roles(cfg, "cuda"):
        return cfg
    seq = prompt_tokens + cfg.rollout.max_new_tokens
    rows, tokens = forward_only_limits(cfg, shape, seq)
    by_tokens = tokens is not None
    base = o.max_tokens_per_micro_batch if by_tokens else o.micro_batch_size
    full = tokens if by_tokens else rows
    assert base is not None and full is not None

    def pinned(n: int) -> RunConfig:
        key = "logprob_max_tokens_per_micro_batch" if by_tokens else "logprob_micro_batch_size"
        return cfg.model_copy(update={"optim": o.model_copy(update={key: n})})

    def fits(n: int) -> bool:  # estimated with the trainer strategy resolved for GPUs
        plans = estimate(
            planned(pinned(n), None), shape, prompt_tokens=prompt_tokens, checkpointed=checkpointed
        )
        return resident_gib(cfg, plans, gpu_memory_gib) <= USABLE * gpu_memory_gib

    if full <= base or fits(full) or not fits(base):
        return cfg
    fit, over = base, full  # the most that fits, the least that does not: the estimate grows with n
    while over - fit > 1:
        mid = (fit + over) // 2
        fit, over = (mid, over) if fits(mid) else (fit, mid)
    return pinned(fit)


def resident_gib(cfg: RunConfig, plans: list[RolePlan], gpu_memory_gib: float) -> float:
    """GiB on actor_train's rank-0 GPU with nothing moved between phases: every training role there at
    its peak as its allocator reserves it (``RESERVED_OVER_ALLOCATED``), each engine at its share and a
    CUDA context (1 GiB) per process, as the runtime's residency check counts the measured peaks
    (``reroll.config.placement.engine_headroom`` with ``resident``)."""
    here = roles_beside(cfg, "actor_train") | {"actor_train"}
    trainers = sum(p.gib for p in plans if p.role in here and p.role != "actor_infer")
    engines = _engines_gib(cfg, "actor_train", gpu_memory_gib)
    return trainers * RESERVED_OVER_ALLOCATED + engines + _contexts(cfg, "actor_train")


def checkpoint_counts(
    cfg: RunConfig, shape: Shape, *, prompt_tokens: int, gpu_memory_gib: float
) -> dict[str, int]:
    """Each training role's count of checkpointed decoder layers: ``model.gradient_checkpointing``'s,
    'auto' chosen per role (``auto_checkpointed_layers``)."""
    setting = cfg.model.gradient_checkpointing
    return {
        spec.name: (
            auto_checkpointed_layers(
                cfg, shape, spec.name, prompt_tokens=prompt_tokens, gpu_memory_gib=gpu_memory_gib
            )
            if setting == "auto"
            else checkpointed_layers(setting, shape.layers)
        )
        for spec in run_roles(cfg, "cuda").values()
        if spec.holds == "strategy" and spec.trainable
    }


def room_beside_phases(
    cfg: RunConfig, shape: Shape, role: str, *, prompt_tokens: int, gpu_memory_gib: float
) -> float:
    """GiB that ``role`` may keep on its GPU through the phases of the other roles that hold a model
    there, by ``estimate`` (each training role's 'auto' count chosen as the run chooses it): 90 % of the
    GPU less the largest of their peaks and a CUDA context (1 GiB) for each process on the GPU, an
    engine's included (asleep, it keeps its context and graphs). ``keeps_state`` weighs the states
    against the engine's share; this weighs them against the phase that runs beside them: a reference
    kept through a 3B trainer's phase that the estimate fills to the limit leaves it short (H100 80GB,
    2026-12-07: out of memory at step 2). Negative: no room at all."""
    cfg = planned(cfg, None)
    counts = checkpoint_counts(cfg, shape, prompt_tokens=prompt_tokens, gpu_memory_gib=gpu_memory_gib)
    plans = estimate(cfg, shape, prompt_tokens=prompt_tokens, checkpointed=counts)
    others = roles_beside(cfg, role) - {"actor_infer"}
    peak = max((p.gib for p in plans if p.role in others), default=0.0)
    return USABLE * gpu_memory_gib - peak - _contexts(cfg, role)


def shards(cfg: RunConfig, world: int, shape: Shape) -> tuple[float, float, float]:
    """Divisors of (weights, gradients, optimizer state) per rank under the strategy."""
    s = cfg.strategy
    if s.name == "fsdp2":
        return world, world, world
    if s.name == "deepspeed":
        return (world if s.deepspeed.zero_stage == 3 else 1), world, world
    if s.name == "megatron":
        m = s.megatron
        model_par = m.tensor_parallel * m.pipeline_parallel
        # routed experts are split by expert parallel on top of tensor/pipeline parallel
        frac = shape.expert_params / shape.params if shape.params else 0.0
        eff = model_par / (1 - frac + frac / m.expert_parallel)
        # Megatron's data-parallel ranks: context-parallel groups lie within them (its own context-parallel
        # size stays 1, reroll.strategies.megatron_context), so its DDP and optimizer count them
        dp = max(world // model_par, 1)
        # the distributed optimizer shards a dense weight's state over the dp ranks, an expert's over the
        # dp / expert_parallel ranks that hold the same experts: every weight's state over tp x pp x dp
        return eff, eff, (model_par * dp if m.distributed_optimizer else eff)
    return 1, world, 1  # torch: full copy; gradients reduced in place


def _trainer(cfg: RunConfig, shape: Shape, seq: int, role: str, world: int, trainable: bool) -> RolePlan:
    w_div, g_div, o_div = shards(cfg, world, shape)
    weights = shape.params * DTYPE_BYTES[cfg.model.dtype] / w_div
    grads = optim = 0.0
    lora = cfg.strategy.lora
    if trainable:
        trained = shape.params
        if lora is not None:  # adapters on every target projection: about r * (in + out) each
            trained = 7 * shape.layers * lora.rank * 2 * shape.hidden * 2
        # megatron's DDP keeps fp32 gradient buffers (grad_reduce_in_fp32, reroll.strategies.megatron)
        grad_bytes = 4 if cfg.strategy.name == "megatron" else DTYPE_BYTES[cfg.model.dtype]
        grads = trained * grad_bytes / (g_div if lora is None else 1)
        # AdamW moments in the parameters' dtype (torch, fsdp2); deepspeed and megatron keep fp32
        # master weights and fp32 moments
        per_param = 12 if cfg.strategy.name in ("deepspeed", "megatron") else 2 * DTYPE_BYTES[cfg.model.dtype]
        optim = trained * per_param / (o_div if lora is None else 1)
    o = cfg.optim
    tokens = o.max_tokens_per_micro_batch or o.micro_batch_size * seq
    everywhere = role == "teacher"  # a teacher's head runs at every position
    rows, budget = forward_only_limits(cfg, shape, seq, every_position=everywhere)
    scored = budget or (rows or 0) * seq
    per = token_bytes(cfg, shape, seq, context_parallel=context_parallel_size(cfg, role))
    scored_logits = per.scored(everywhere)
    # a rank's larger pass: training (activations kept for backward, the head's output and gradient)
    # or forward-only (one layer's activations at a time, the head's output; optim.logprob_*)
    acts, logits = (tokens * per.kept, tokens * per.train_logits) if trainable else (0.0, 0.0)
    if scored * (per.layer + scored_logits) > acts + logits:
        acts, logits = scored * per.layer, scored * scored_logits
    logits += LOGPROB_WORKSPACE
    total = weights + grads + optim + acts + logits
    parts = (
        f"weights {weights / GIB:.1f} + grads {grads / GIB:.1f} + adam {optim / GIB:.1f} + "
        f"activations {acts / GIB:.1f} + logits {logits / GIB:.1f}"
    )
    # offloaded between phases (after the optimizer step has dropped the gradients, which deepspeed and
    # megatron keep in buffers of their own)
    parked = weights + optim + (grads if cfg.strategy.name in ("deepspeed", "megatron") else 0.0)
    return RolePlan(role, world, total / GIB, parts, parked / GIB)


def _kv_per_token(cfg: RunConfig, shape: Shape, tp: int) -> float:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * DTYPE_BYTES[cfg.model.dtype] / tp


def _gpu_engine(cfg: RunConfig) -> EngineSpec:
    """The spec of the engine a GPU run starts ('auto' resolved as on a GPU of this machine)."""
    return engine_spec(resolve_engine(cfg.rollout.engine, "cuda"))


@dataclass(frozen=True)
class EngineShare:
    """One engine rank's share of its GPU (``EngineSpec.memory_share``) against what its start needs."""

    share: float  # the fraction set
    gpu_gib: float
    need_gib: float  # weights + overhead + one sequence's KV cache
    parts: str
    context_kv_gib: float = 0.0  # that KV cache, where its length is the model's context by default

    @property
    def share_gib(self) -> float:
        return self.share * self.gpu_gib

    @property
    def least(self) -> float:
        """The smallest fraction that holds the need, rounded up to 3 decimals."""
        return math.ceil(self.need_gib / self.gpu_gib * 1000) / 1000


def engine_share(
    cfg: RunConfig, shape: Shape, *, gpu_memory_gib: float, prompt_tokens: int
) -> EngineShare | None:
    """A GPU engine rank's share against its weights, the overhead its spec states (``share_overhead``)
    and the KV cache of one sequence of the engine's longest (vLLM refuses to start without room for
    one of its max_model_len): its ``max_model_len`` where set, else the model's context where known,
    else ``prompt_tokens`` plus ``rollout.max_new_tokens``. None for an engine without a fixed share or
    a stated overhead."""
    spec, r = _gpu_engine(cfg), cfg.rollout
    share = spec.memory_share(r)
    if share is None or spec.share_overhead is None:
        return None
    tp, dtype = spec.span(r), DTYPE_BYTES[cfg.model.dtype]
    weights = shape.params * dtype / tp
    overhead = spec.share_overhead(r, shape, dtype, gpu_memory_gib * GIB)
    # vLLM's max_model_len, unset, is the model's context (max_position_embeddings, read where the
    # model is local)
    seq = spec.max_model_len(r) or shape.context or prompt_tokens + r.max_new_tokens
    kv = seq * _kv_per_token(cfg, shape, tp)
    parts = (
        f"weights {weights / GIB:.2f} + start-up profile and buffers {overhead / GIB:.2f} + "
        f"kv cache of one {seq}-token sequence {kv / GIB:.2f}"
    )
    by_context = not spec.max_model_len(r) and shape.context > 0
    return EngineShare(share, gpu_memory_gib, (weights + overhead + kv) / GIB, parts, kv / GIB * by_context)


def engine_share_problem(
    cfg: RunConfig, shape: Shape, *, gpu_memory_gib: float, prompt_tokens: int
) -> tuple[str, str] | None:
    """``(dotted path, message)`` where a GPU engine rank's share cannot hold its start (``engine_share``):
    the engine would fail while sizing its KV cache, after the roles have started."""
    s = engine_share(cfg, shape, gpu_memory_gib=gpu_memory_gib, prompt_tokens=prompt_tokens)
    if s is None or s.share_gib >= s.need_gib:
        return None
    n = colocated_engines(cfg, "actor_infer") if cfg.placement.devices else 1
    fewer = (
        f", or start fewer engines on a GPU ({n} share one now: roles.actor_infer.world_size) and give each "
        "a larger share"
        if n > 1
        else ""
    )
    spec = _gpu_engine(cfg)
    shorter = (
        f", or set {spec.max_model_len_key} to the longest prompt + response (unset, it is the model's "
        f"context, whose one sequence takes {s.context_kv_gib:.2f} GiB)"
        if s.context_kv_gib and spec.max_model_len_key
        else ""
    )
    return (
        spec.memory_share_key,
        f"{s.share:g} of a {s.gpu_gib:.1f} GiB GPU is {s.share_gib:.2f} GiB for one engine rank, which needs "
        f"{s.need_gib:.2f} GiB to start ({s.parts}): set it to at least {s.least:g}{fewer}{shorter}",
    )


def _engine(cfg: RunConfig, shape: Shape, seq: int, world: int) -> RolePlan:
    spec = engine_spec(cfg.rollout.engine)
    tp = spec.span(cfg.rollout)
    weights = shape.params * DTYPE_BYTES[cfg.model.dtype] / tp
    kv_per_token = _kv_per_token(cfg, shape, tp)
    seqs = min(cfg.rollout.batch_size // world, cfg.rollout.generate_batch_size)
    kv = seqs * seq * kv_per_token
    parts = f"weights {weights / GIB:.1f} + kv cache {kv / GIB:.1f} ({seqs} seqs x {seq} tokens)"
    asleep = (
        weights if spec.memory_share(cfg.rollout) is not None and spec.parks_weights(cfg.rollout) else 0.0
    )
    return RolePlan("actor_infer", world * tp, (weights + kv) / GIB, parts, asleep / GIB)
