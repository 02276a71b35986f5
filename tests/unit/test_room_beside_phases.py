"""What a colocated role may keep on its GPU through another role's phase (``room_beside_phases``): a
role whose state the engine's share would leave resident (``keeps_state``) still moves where the phase
beside it, by the plan's estimate, needs the room. Found on an H100 80GB (2026-12-07): the 3B row with
``model.gradient_checkpointing: auto`` checkpointed layers until actor_train's phase alone filled 90 %
of the GPU, the reference kept its 6 GiB of weights through that phase, and the trainer ran out of
memory at step 2."""

from __future__ import annotations

import pytest

from reroll.config.memory import KNOWN
from reroll.config.placement import (
    PARKING_MARGIN,
    colocated_engines,
    colocated_trainer_roles,
    keeps_state,
    may_park,
)
from reroll.config.role_memory import (
    GIB,
    RESERVED_OVER_ALLOCATED,
    USABLE,
    checkpoint_counts,
    estimate,
    planned,
    room_beside_phases,
)
from tests.conftest import small_config

H100 = 79.18  # GiB torch reports for an H100 80GB HBM3


def _bench(tmp_path, checkpointing, share=0.15):
    """grpo_step.py's colocated row: actor_train, reference and a vLLM engine at ``share`` (0.15 on an
    80 GB card) on one GPU."""
    return small_config(
        tmp_path,
        "model.dtype=bfloat16",
        "optim.micro_batch_size=64",
        "optim.logprob_micro_batch_size=64",
        "rollout.max_new_tokens=256",
        "placement.devices=1",
        "rollout.engine=vllm",
        f"rollout.vllm.gpu_memory_utilization={share}",
        "algorithm.kl_coef=0.04",
        f"model.gradient_checkpointing={checkpointing}",
    )


def test_the_room_is_the_usable_gpu_less_the_largest_other_phase_and_the_contexts(tmp_path):
    cfg, shape = _bench(tmp_path, "auto"), KNOWN["qwen2.5-3b"]
    pl = planned(cfg, None)
    counts = checkpoint_counts(pl, shape, prompt_tokens=128, gpu_memory_gib=H100)
    plans = {p.role: p.gib for p in estimate(pl, shape, prompt_tokens=128, checkpointed=counts)}
    contexts = colocated_trainer_roles(cfg, "reference") + colocated_engines(cfg, "reference")
    assert contexts == 3  # actor_train, reference and the engine: one process each
    room = room_beside_phases(cfg, shape, "reference", prompt_tokens=128, gpu_memory_gib=H100)
    assert room == pytest.approx(USABLE * H100 - plans["actor_train"] - contexts)  # the engine's share: not
    # a phase of its own here (keeps_state weighs it)


@pytest.mark.parametrize(
    ("size", "checkpointing", "share", "kept"),
    [
        ("qwen2.5-3b", "auto", 0.35, False),
        ("qwen2.5-3b", "auto", 0.15, True),
        ("qwen2.5-3b", True, 0.15, True),
        ("qwen2.5-0.5b", False, 0.15, True),
    ],
)
def test_the_reference_keeps_its_weights_only_where_the_trainers_phase_leaves_room(
    tmp_path, size, checkpointing, share, kept
):
    """The reference's state is its bf16 weights. Beside the engine's share alone it always stays
    (``keeps_state``); beside actor_train's phase it stays at 0.5B, at 3B with every layer
    checkpointed and at 3B under 'auto' where the engine's share of 0.15 lets 'auto' keep the engine
    awake (``awake_beside`` counts the reference's state), and moves (its host buffers prepared ahead,
    ``may_park``) where the engine's 0.35 leaves no count that keeps it awake, so that 'auto' lets the
    3B trainer's phase fill the usable GPU."""
    cfg, shape = _bench(tmp_path, checkpointing, share), KNOWN[size]
    weights = int(shape.params * 2)
    total = int(H100 * GIB)
    assert keeps_state(cfg, "reference", weights, total)
    room = room_beside_phases(cfg, shape, "reference", prompt_tokens=128, gpu_memory_gib=H100) * GIB
    assert (weights <= room) == kept
    assert may_park(cfg, "reference", weights, total, room=room) == (weights * PARKING_MARGIN > room)
    if not kept:
        assert may_park(cfg, "reference", weights, total, room=room)


@pytest.mark.parametrize(("checkpointing", "kept"), [("auto", False), (True, True)])
def test_the_reference_worker_moves_where_the_trainers_phase_needs_its_room(
    tmp_path, monkeypatch, checkpointing, kept
):  # at the engine's share of 0.35, where 'auto' cannot keep the 3B engine awake and fills the GPU
    """``StrategyWorker._fits_beside_engine`` (CUDA's memory calls faked: 6 GiB reserved, the 3B
    reference's weights, on an H100) reads the room at the longest prompt it has seen."""
    import math
    import types

    import torch

    from reroll.roles import strategy_worker
    from reroll.roles.strategy_worker import StrategyWorker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = types.SimpleNamespace(total_memory=int(H100 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * GIB)
    monkeypatch.setattr(strategy_worker, "worker_device", lambda cfg, role: "cuda")

    class Strategy:
        device = torch.device("cuda", 0)

        def prepare_offload(self, worth_it):
            pass

    worker = object.__new__(StrategyWorker)
    worker.cfg = _bench(tmp_path, checkpointing, 0.35).model_copy()
    worker.cfg.placement.device_type = "cuda"
    worker.role, worker.strategy = "reference", Strategy()
    worker._shape, worker._widest, worker._room = KNOWN["qwen2.5-3b"], (384, 128), (0, math.inf)
    assert worker._fits_beside_engine() == kept


@pytest.mark.parametrize(("share", "awake"), [(0.15, True), (0.35, False)])
def test_auto_checkpoints_enough_layers_for_the_engine_to_stay_awake_where_a_count_can(
    tmp_path, share, awake
):
    """'auto' first looks for the fewest layers at which actor_train's phase, the engine's share, the
    reference's weights and a CUDA context for each of the three processes fit in 90 % of the GPU (what
    the run's residency check asks before it keeps the engine awake: ``engine_headroom``), and only
    where no count does for the fewest at which the phase alone fits (the engine then sleeps, and the
    weights go through host memory: 20 s of the 3B row's 28 s step on an H100, 2026-12-07). The trainer's
    phase is weighed as its allocator reserves it (``RESERVED_OVER_ALLOCATED``), as the runtime measures
    it; the phase alone as the estimate's tensors. The estimate is arithmetic, so the bounds are exact:
    the chosen count fits, one fewer does not."""
    cfg, shape = planned(_bench(tmp_path, "auto", share), None), KNOWN["qwen2.5-3b"]
    count = checkpoint_counts(cfg, shape, prompt_tokens=128, gpu_memory_gib=H100)["actor_train"]

    def need(n: int, with_engine: bool) -> float:
        plans = {p.role: p for p in estimate(cfg, shape, prompt_tokens=128, checkpointed={"actor_train": n})}
        if not with_engine:
            return plans["actor_train"].gib
        return (
            plans["actor_train"].gib * RESERVED_OVER_ALLOCATED
            + share * H100
            + 3
            + plans["reference"].parked_gib
        )

    assert need(count, with_engine=awake) <= USABLE * H100 < need(count - 1, with_engine=awake)
    if not awake:  # no count keeps it awake, not even the most the estimate checkpoints
        assert need(shape.layers - 1, with_engine=True) > USABLE * H100


def test_the_plan_names_the_counts_fewer_rows_a_micro_batch_would_recompute(tmp_path):
    """Where 'auto' recomputes half of the trainer's layers or more, the plan gives the counts it would
    choose at a half and a quarter of the rows (the 3B row at 64 rows: 33 of 36 layers on an H100; at
    16 rows 7, which trained faster there, 2026-12-07). Each count is ``checkpoint_counts``' own at that
    micro-batch; nothing is said at a fixed count, or where 'auto' recomputes under half the layers."""
    from reroll.plan import _smaller_micro_batch_lines

    shape = KNOWN["qwen2.5-3b"]

    def lines(checkpointing, rows=64):
        cfg = planned(_bench(tmp_path, checkpointing), None)
        cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"micro_batch_size": rows})})
        counts = checkpoint_counts(cfg, shape, prompt_tokens=128, gpu_memory_gib=H100)
        return counts["actor_train"], _smaller_micro_batch_lines(cfg, shape, counts, 128, H100)

    def count_at(rows):
        return lines("auto", rows)[0]

    n, [line] = lines("auto")
    assert 2 * n >= shape.layers and count_at(16) < count_at(32) < n
    assert f"32 rows: {count_at(32)} of 36; 16 rows: {count_at(16)} of 36" in line
    assert lines(30)[1] == [] and lines(True)[1] == []
    assert 2 * count_at(16) < shape.layers and lines("auto", 16)[1] == []
