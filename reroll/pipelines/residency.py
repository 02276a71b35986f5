"""Advice on GPU memory where colocated roles share a GPU with an engine that holds a fixed share of it.

``staying`` decides, at every eviction, which roles stay resident beside the engine (from the trainers'
measured memory); ``share_hint`` says what share would let the engine stay awake; ``ENGINE_AWAKE_OOM``
explains a trainer out of memory beside an awake engine, and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reroll.config.engines import engine_spec
from reroll.config.placement import colocated_engines, engine_headroom
from reroll.config.run import RunConfig

ENGINE_AWAKE_OOM = (
    "The vLLM engine was awake beside the trainers: placement.offload 'auto' keeps it awake where the "
    "worst trainer phase (one trainer's measured peak, scaled to responses of rollout.max_new_tokens, "
    "beside the others' state; every trainer's peak where nothing moves) fits beside its share of the "
    "GPU, and this step needed more. Give the trainers room: lower rollout.vllm.gpu_memory_utilization "
    "or optim.micro_batch_size / optim.logprob_micro_batch_size (or set placement.offload: always), then "
    "continue with `reroll train CONFIG --resume`."
)


def share_hint(share: float, engine: int, resident: int, total: int, engines: int = 1) -> str:
    """What a run whose engine sleeps beside the measured trainers could do about it: the engine's
    shares (``rollout.vllm.gpu_memory_utilization``) at which it would stay awake, and at which nothing
    would move (``engine`` and ``resident``: bytes to spare at ``share``, negative; ``engines`` on the
    GPU, each taking ``share``)."""
    # the shares where the headroom reaches 0 (it falls by the GPU's bytes per unit of share and
    # engine), shown rounded down
    awake, still = (
        math.floor((share + spare / (engines * total)) * 100 + 1e-6) / 100 for spare in (engine, resident)
    )
    who = "the vLLM engine sleeps" if engines == 1 else f"the {engines} vLLM engines on the GPU sleep"
    each = "its share" if engines == 1 else "their shares"
    line = (
        f"placement: {who} through the trainers' phases (a sleep, a wake and a slower weight sync each "
        f"step): beside {each} (rollout.vllm.gpu_memory_utilization {share:g} = {share * total / 2**30:.1f} "
        f"GiB{' each' if engines > 1 else ''}) the worst trainer phase, as measured, is "
        f"{-engine / 2**30:.1f} GiB short of 90 % of the GPU."
    )
    if awake < 0.05:
        return line + " The trainers alone leave the engine no room to stay awake on this GPU."
    nothing = f", and nothing would move at {still:.2f} or less" if still >= 0.05 else ""
    return (
        f"{line} It would stay awake at a share of {awake:.2f} or less{nothing}, if the engine still fits in "
        "it (engine/kv_cache_usage says how much of its KV cache a step used)."
    )


@dataclass(frozen=True)
class Residency:
    """What ``staying`` decided at an eviction: the roles left resident, and the headrooms behind it."""

    roles: set[str]
    engine: int | None = None  # bytes to spare with the engine awake beside the worst trainer phase
    resident: int | None = None  # bytes to spare with nothing moved at all
    total: int = 0  # the GPU's bytes
    engines: int = 1  # engines on the GPU, each taking ``share`` of it
    share: float = 0.0

    def hint(self) -> str | None:
        """``share_hint`` where the engine sleeps though the trainers have measured themselves."""
        if self.roles or self.engine is None:
            return None
        return share_hint(self.share, self.engine, self.resident or 0, self.total, self.engines)


def colocated_needs(
    groups: dict[str, Any], colocated: Callable[[str, str], bool]
) -> dict[str, tuple[int, int, int]] | None:
    """Each role that shares the engine's device: its ``memory_need()``, ``(most bytes in a phase,
    resting bytes, the GPU's bytes)``, measured (``(0, 0, 0)`` before its first pass). None where one
    cannot say (no ``memory_need``): the engine then sleeps, and no sync wakes its weights alone."""
    needs = {}
    for name, group in groups.items():
        if name != "actor_infer" and colocated(name, "actor_infer"):
            if not hasattr(group, "memory_need"):
                return None
            needs[name] = group.memory_need()
    return needs


def staying(cfg: RunConfig, groups: dict[str, Any], colocated: Callable[[str, str], bool]) -> Residency:
    """The roles left resident at an eviction, beside the engine's share of the GPU, from the colocated
    trainers' measured memory (``memory_need``: a role's peak scaled to the longest responses, its state
    between phases), remade at every eviction (the first step measures, with everything moving): every
    role where all the trainers' peaks fit beside the engine at once (nothing moves, no allocator cache
    is freed; ``resident`` headroom); else the engine alone where the worst trainer phase (one role's
    peak beside the others' state) fits beside it (no sleep, no wake, a weight sync into an awake
    engine; ``engine`` headroom); else none (``engine_headroom``). ``colocated(a, b)``: whether two
    roles share a device."""
    found = colocated_needs(groups, colocated)
    if found is None:
        return Residency(set())  # a role that cannot say what it needs: the engine sleeps
    trainers = list(found)
    needs = [(peak, rest) for peak, rest, _ in found.values()]
    total = max((gpu for *_, gpu in found.values()), default=0)  # one GPU: every role measures the same
    share = engine_spec(cfg.rollout.engine).memory_share(cfg.rollout) or 0.0
    engines = max((colocated_engines(cfg, name) for name in trainers), default=1)
    engine = engine_headroom(needs, share, total, engines=engines)
    resident = engine_headroom(needs, share, total, resident=True, engines=engines)
    if resident is not None and resident >= 0:
        roles = {"actor_infer", *trainers}
    elif engine is not None and engine >= 0:
        roles = {"actor_infer"}
    else:
        roles = set()
    return Residency(roles, engine, resident, total, engines, share)
