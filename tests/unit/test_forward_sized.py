"""The forward-only passes' size where the library chooses it (``optim.logprob_*`` unset) beside an
engine that may stay awake (``forward_sized``): as many rows as a training micro-batch's memory holds,
but no more than lets every colocated role stay resident where training's size does. Found on an H100
80GB (2026-12-06): the 0.5B row at the library's size took 3.77 s a step against 3.63 s at training's
64 rows, the reference's larger pass having pushed the trainers out of residency."""

from __future__ import annotations

import math
import types

import pytest
import torch

from reroll.config.memory import KNOWN, forward_only_limits
from reroll.config.role_memory import (
    USABLE,
    checkpoint_counts,
    estimate,
    forward_sized,
    planned,
    resident_gib,
    with_checkpointing,
)
from tests.conftest import small_config

H100 = 79.18  # GiB torch reports for an H100 80GB HBM3


def _bench(tmp_path, share=0.15, *extra):
    """grpo_step.py's colocated row (actor_train, reference and a vLLM engine at ``share`` on one GPU),
    the forward-only passes left to the library."""
    return small_config(
        tmp_path,
        "model.dtype=bfloat16",
        "optim.micro_batch_size=64",
        "rollout.max_new_tokens=256",
        "placement.devices=1",
        "rollout.engine=vllm",
        f"rollout.vllm.gpu_memory_utilization={share}",
        "algorithm.kl_coef=0.04",
        "model.gradient_checkpointing=auto",
        *extra,
    )


def _sized(cfg, shape):
    cfg = planned(cfg, None)
    counts = checkpoint_counts(cfg, shape, prompt_tokens=128, gpu_memory_gib=H100)
    return cfg, counts, forward_sized(cfg, shape, prompt_tokens=128, gpu_memory_gib=H100, checkpointed=counts)


def test_the_most_rows_at_which_every_role_stays_resident(tmp_path):
    """0.5B at the 0.15 share: training's 64 rows let every role stay (the trainer's phase, the
    reference's pass, the engine's share and three contexts under 90 % of the GPU), the library's size
    would not; the pinned count is the most that does. The estimate is arithmetic: exact bounds."""
    shape = KNOWN["qwen2.5-0.5b"]
    cfg, counts, sized = _sized(_bench(tmp_path), shape)
    n = sized.optim.logprob_micro_batch_size
    library, _ = forward_only_limits(with_checkpointing(cfg, counts["actor_train"]), shape, 384)

    def resident(rows: int) -> float:
        pinned = cfg.model_copy(
            update={"optim": cfg.optim.model_copy(update={"logprob_micro_batch_size": rows})}
        )
        return resident_gib(cfg, estimate(pinned, shape, prompt_tokens=128, checkpointed=counts), H100)

    assert 64 < n < library
    assert resident(64) <= resident(n) <= USABLE * H100 < resident(n + 1)
    assert resident(library) > USABLE * H100


@pytest.mark.parametrize(
    ("size", "share", "extra"),
    [
        ("qwen2.5-0.5b", 0.15, ("optim.logprob_micro_batch_size=32",)),  # the user's size
        ("qwen2.5-0.5b", 0.15, ("placement.offload=always",)),  # nothing may stay: passes as large as fit
        ("qwen2.5-0.5b", 0.35, ()),  # training's 64 rows do not let every role stay either
        ("qwen2.5-3b", 0.15, ()),  # nor at 3B
    ],
    ids=["user-set", "offload-always", "0.5b-share-0.35", "3b"],
)
def test_the_library_size_stands_where_residency_is_not_to_be_had_or_not_asked(tmp_path, size, share, extra):
    cfg, _, sized = _sized(_bench(tmp_path, share, *extra), KNOWN[size])
    assert sized is cfg


def test_plan_says_why_the_forward_passes_are_that_size(tmp_path):
    from reroll.plan import plan

    cfg = _bench(tmp_path, 0.15, "model.path=Qwen/Qwen2.5-0.5B")
    _, _, sized = _sized(cfg, KNOWN["qwen2.5-0.5b"])
    text, fits = plan(cfg, gpus=1, gpu_memory_gib=H100, prompt_tokens=128)
    n = sized.optim.logprob_micro_batch_size
    assert (
        fits and f"{n} rows at a time (optim.logprob_* unset: the most that lets every colocated role" in text
    )


def test_a_worker_on_a_gpu_takes_the_resident_size(tmp_path, monkeypatch):
    """``StrategyWorker._limits`` (CUDA's device properties faked: an H100) for a forward-only pass of
    rows 384 tokens wide: the size ``forward_sized`` pins, at the count training checkpoints."""
    from reroll.roles.strategy_worker import StrategyWorker

    gib = 2**30
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=int(H100 * gib))
    )
    cfg = _bench(tmp_path)
    _, _, sized = _sized(cfg, KNOWN["qwen2.5-0.5b"])
    worker = object.__new__(StrategyWorker)
    worker.cfg, worker.head_everywhere = cfg, False
    worker.strategy = types.SimpleNamespace(device=torch.device("cuda", 0))
    worker._shape, worker._sized, worker._room = KNOWN["qwen2.5-0.5b"], {}, (0, math.inf)
    worker._checkpointing = types.SimpleNamespace(count=0)  # 'auto' at 0.5B: no layer
    assert worker._limits(True, 384) == {"max_rows": sized.optim.logprob_micro_batch_size, "max_tokens": None}
    assert worker._limits(False, 384) == {"max_rows": 64, "max_tokens": None}  # training's own
