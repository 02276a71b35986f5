"""Streaming rewards with over-sampling, and partial rollouts, through the real CLI (issue 15 items 2-3)."""

from __future__ import annotations

import math

import pytest

from reroll.cli import main
from reroll.engines import engine_available
from reroll.runtime.metrics import read_metrics
from tests.conftest import step_metrics, write_config

pytestmark = pytest.mark.integration

SEVENS = {"fn": "tests.integration.shaped_rewards:sevens"}


def _rows(run_dir):
    return {m["step"]: m for m in read_metrics(run_dir) if m["step"] > 0}


def _resumed_after_step_1_matches(tmp_path, run: list[str]) -> None:
    """``run`` stopped after step 1 and resumed logs steps 2-3 as the run named ``straight`` did."""
    assert main([*run, "name=stopped", "total_steps=1"]) == 0
    assert main([*run, "name=stopped", "--resume"]) == 0
    for step in (2, 3):
        straight = step_metrics(tmp_path / "runs" / "straight", step)
        resumed = step_metrics(tmp_path / "runs" / "stopped", step)
        assert straight.keys() == resumed.keys()
        for key in straight:
            assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-6), (step, key)


def test_oversampling_keeps_the_first_groups_and_reports_what_it_dropped(tmp_path, assets):
    """hf engine, 2 prompts per micro-batch: 6 prompts drawn for 4 groups (oversample 1.5); the engine
    yields groups a micro-batch at a time, so the step keeps 4, interrupts, and drops the 2 not
    generated (0 tokens: unfinished); it trains on a full batch, and a resumed run matches."""
    rollout = {"oversample": 1.5, "generate_batch_size": 8, "max_new_tokens": 6}
    sections = {"eval": {"every": 0}, "rollout": rollout, "reward": SEVENS, "checkpoint": {"every": 1}}
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, **sections)
    run = ["train", str(cfg), "runtime.backend=local"]
    assert main([*run, "name=straight"]) == 0
    rows = _rows(tmp_path / "runs" / "straight")
    for m in rows.values():
        assert m["rollout/oversample_dropped_groups"] == 2
        assert m["rollout/oversample_dropped_unfinished"] == 1  # interrupted before they started
        assert m["rollout/oversample_dropped_length"] == 0
        assert m["rollout/oversample_kept_length"] == m["rollout/response_length"] > 0
        assert m["filter/kept_samples"] == 16  # a full batch
        assert math.isfinite(m["actor/loss"])
    _resumed_after_step_1_matches(tmp_path, run)


ASYNC_POOL = ["placement.devices=2", "placement.cpus_per_device=0.5", "roles.actor_infer.devices=[1]"]


def test_oversampling_one_step_off_policy_keeps_the_first_groups_the_engine_finishes(tmp_path, assets):
    """Over-sampling with ``async_steps``: the engine keeps the first 4 of 6 groups and interrupts the rest
    itself (the driver is training meanwhile), as the synchronous round above does; the kept groups are
    one step old from step 2 on, and a resumed run (the queue's dropped responses saved with it) matches."""
    rollout = {"oversample": 1.5, "generate_batch_size": 8, "max_new_tokens": 6, "async_steps": 1}
    sections = {"eval": {"every": 0}, "rollout": rollout, "reward": SEVENS, "checkpoint": {"every": 1}}
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, **sections)
    run = ["train", str(cfg), "runtime.backend=local"]
    assert main([*run, "name=straight"]) == 0
    rows = _rows(tmp_path / "runs" / "straight")
    assert [rows[s]["staleness/max"] for s in (1, 2, 3)] == [0, 1, 1]
    for m in rows.values():
        assert m["rollout/oversample_dropped_groups"] == 2
        assert m["rollout/oversample_dropped_unfinished"] == 1  # interrupted before they started
        assert m["rollout/oversample_kept_length"] == m["rollout/response_length"] > 0
        assert m["filter/kept_samples"] == 16  # a full batch
        assert math.isfinite(m["actor/loss"])
    _resumed_after_step_1_matches(tmp_path, run)


def test_oversampling_off_policy_through_ray_on_an_engine_of_its_own(tmp_path, assets):
    """The same through Ray, actor_infer on a pool slot of its own: its worker stops its own generation."""
    rollout = {"oversample": 1.5, "generate_batch_size": 8, "max_new_tokens": 6, "async_steps": 1}
    sections = {"eval": {"every": 0}, "rollout": rollout, "reward": SEVENS}
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=2, **sections)
    assert main(["train", str(cfg), *ASYNC_POOL]) == 0
    rows = _rows(tmp_path / "runs" / "t")
    assert [rows[s]["staleness/max"] for s in (1, 2)] == [0, 1]
    assert all(
        m["rollout/oversample_dropped_groups"] == 2 and m["filter/kept_samples"] == 16 for m in rows.values()
    )


PARTIAL = {"max_new_tokens": 64, "generate_batch_size": 2, "async_steps": 1, "partial_rollouts": True}


def test_partial_rollouts_continue_in_flight_generations_with_new_weights(tmp_path, assets):
    """Ray, async_steps 1, hf engine on its own slot. Generation (64 tokens, 2 rows per micro-batch:
    8 micro-batches in lockstep) takes much longer than a training step of the tiny model, so the
    weight update after step 1 interrupts step 2's generation: its responses carry tokens of policy 0
    and of policy 1 (mixed samples, staleness between 0 and 1). Where the update lands is a race (on a
    loaded machine the training step can outlast a generation), so any of steps 2-3 may show it."""
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, eval={"every": 0}, rollout=PARTIAL)
    assert main(["train", str(cfg), *ASYNC_POOL, "checkpoint.every=0"]) == 0
    rows = _rows(tmp_path / "runs" / "t")
    assert all(math.isfinite(m["actor/loss"]) for m in rows.values())
    assert rows[1]["staleness/mixed_samples"] == 0  # the first batch: the starting weights only
    mixed = [m for step, m in rows.items() if step > 1 and m["staleness/mixed_samples"] > 0]
    assert mixed, [rows[step] for step in (2, 3)]  # interrupted at an update, continued
    assert all(0 < m["staleness/off_policy_tokens"] < 1 and m["staleness/max"] == 1 for m in mixed)


@pytest.mark.long
def test_partial_rollouts_resume_trains_on_the_saved_versions(tmp_path, assets):
    """The checkpoint keeps the queue with its per-token versions (waited for, continuations
    included), and the resumed run trains its next step on exactly those (the rest of a partial
    rollout run depends on where the interrupts land, so it is not reproducible run to run)."""
    import torch

    from reroll.data.types import Completion, Rollout, Sample
    from reroll.pipelines.rollout_source import Scored, staleness_metrics

    sections = {"eval": {"every": 0}, "rollout": PARTIAL, "checkpoint": {"every": 1}}
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=2, **sections)
    assert main(["train", str(cfg), *ASYNC_POOL]) == 0
    saved = torch.load(tmp_path / "runs" / "t" / "checkpoints" / "step_000002" / "rollout_queue.pt")
    [queued] = saved["queued"]  # step 3's generation, waited for, with its tokens' versions
    assert queued["step"] == 3 and queued["versions"] is not None
    groups = [[Completion(**c) for c in g] for g in queued["groups"]]
    for g, vg in zip(groups, queued["versions"]):
        assert [len(v) for v in vg] == [len(c.response_ids) for c in g]
    assert main(["train", str(cfg), *ASYNC_POOL, "total_steps=3", "--resume"]) == 0
    sample = Sample(**queued["prompts"][0])
    versions = [v for vg in queued["versions"] for v in vg]
    scored = Scored([Rollout(sample, 0, c) for g in groups for c in g], [], versions)
    step3 = _rows(tmp_path / "runs" / "t")[3]
    for key, value in staleness_metrics(scored, trainer_version=2).items():
        assert step3[key] == pytest.approx(value), key
    assert step3["rollout/response_length"] == pytest.approx(
        sum(len(c.response_ids) for g in groups for c in g) / len(versions)
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.partial_rollouts=true"], "rollout.partial_rollouts: continues the generations in flight"),
        (
            ["rollout.partial_rollouts=true", "rollout.async_steps=1", *ASYNC_POOL, "runtime.backend=local"],
            "rollout.partial_rollouts: runtime.backend 'local' runs each generation to its end",
        ),
        (
            [
                "rollout.oversample=1.25",
                "rollout.async_steps=1",
                "rollout.partial_rollouts=true",
                *ASYNC_POOL,
            ],
            "rollout.oversample: streaming with over-sampling does not run with rollout.partial_rollouts yet",
        ),
        (
            ["rollout.oversample=1.25", "rollout.engine=sglang"],
            "rollout.oversample: needs an engine that streams and can be interrupted (hf, vllm)",
        ),
        (["rollout.oversample=0.5"], "rollout.oversample"),
    ],
)
def test_streaming_configs_that_cannot_run_are_refused_at_validate(
    tmp_path, assets, capsys, overrides, message
):
    cfg = write_config(tmp_path / "c.yaml", assets)
    assert main(["validate", str(cfg), *overrides]) == 2
    assert message in capsys.readouterr().err


needs_vllm = pytest.mark.skipif(not engine_available("vllm"), reason="vllm is not installed")


@pytest.mark.long
@needs_vllm
@pytest.mark.parametrize("async_steps", [0, 1])
def test_oversampling_with_vllm_keeps_the_groups_that_finish_first(tmp_path, assets, async_steps):
    """vLLM decodes every request together and finishes each at its own step: the groups kept are
    those whose samples all stopped first, so the kept responses are shorter than the dropped ones
    (which had at least as many tokens as the longest kept one when the engine was interrupted).
    One step off-policy the engine worker interrupts its own generation."""
    rollout = {"oversample": 2.0, "max_new_tokens": 32, "engine": "vllm", "async_steps": async_steps}
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, eval={"every": 0}, rollout=rollout)
    assert main(["train", str(cfg), "runtime.backend=local"]) == 0
    rows = _rows(tmp_path / "runs" / "t")
    for m in rows.values():
        assert m["filter/kept_samples"] == 16 and math.isfinite(m["actor/loss"])
        assert m["rollout/oversample_dropped_groups"] == 4
        assert m["rollout/oversample_kept_length"] < m["rollout/oversample_dropped_length"], m


@pytest.mark.long
@needs_vllm
def test_partial_rollouts_with_vllm(tmp_path, assets):
    """vLLM on its own slot, 64 samples of up to 64 tokens a step: the update interrupts the next
    step's generation, whose samples then carry two policy versions. Whether an update lands while a
    generation still runs is a race (vLLM may finish first): one of steps 2-4 must show it (with
    steps 2-3 alone, 1 run in 5 saw none)."""
    rollout = {**PARTIAL, "engine": "vllm", "batch_size": 64}
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=4, eval={"every": 0}, rollout=rollout)
    assert main(["train", str(cfg), *ASYNC_POOL, "checkpoint.every=0", "optim.micro_batch_size=64"]) == 0
    rows = _rows(tmp_path / "runs" / "t")
    assert all(math.isfinite(m["actor/loss"]) for m in rows.values())
    assert max(rows[s]["staleness/mixed_samples"] for s in (2, 3, 4)) > 0, rows
