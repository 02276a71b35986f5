"""RLVR's rollout source through the real CLI and Ray: DAPO refills, off-policy (async) training."""

from __future__ import annotations

import math

import pytest

from reroll.cli import main
from reroll.runtime.metrics import read_metrics
from tests.conftest import step_metrics, write_config

pytestmark = pytest.mark.integration


def test_dapo_refills_train_full_batches_of_groups_with_a_spread(tmp_path, assets):
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        total_steps=2,
        eval={"every": 0},
        sft={"steps": 30, "batch_size": 16, "lr": 1e-3},
        algorithm={"dynamic_sampling": True, "dynamic_sampling_max_rounds": 4},
    )
    assert main(["train", str(cfg), "runtime.backend=local"]) == 0
    steps = [m for m in read_metrics(tmp_path / "runs" / "t") if m["step"] > 0]
    for m in steps:
        assert 1 <= m["dapo/rounds"] <= 5
        kept = m["dapo/kept_groups"]
        assert kept + m["dapo/missing_groups"] == 4  # batch_size 16 / group_size 4
        assert m["filter/kept_samples"] == 4 * kept  # the trained groups have a spread; the rest ...
        assert m["filter/equal_reward_dropped"] == 4 * m["dapo/missing_groups"]  # ... made it up
        assert m["dapo/rounds"] == 5 or m["dapo/missing_groups"] == 0  # stops early only when full
    assert any(m["dapo/filtered_groups"] > 0 for m in steps)


SEVENS = {"fn": "tests.integration.shaped_rewards:sevens"}  # a dense reward the tiny model learns fast
ASYNC_POOL = [  # actor_infer on a CPU slot of its own: generation overlaps training
    "placement.devices=2",
    "placement.cpus_per_device=0.5",
    "roles.actor_infer.devices=[1]",
]


def _rows(run_dir):
    return {m["step"]: m for m in read_metrics(run_dir) if m["step"] > 0}


def test_async_one_step_off_policy_learns_like_sync(tmp_path, assets):
    """Local backend (same queue, no overlap): async_steps 1 trains on samples exactly one step stale,
    with the importance weights on and logged, and its reward rises like the synchronous run's."""
    cfg = write_config(
        tmp_path / "c.yaml",
        assets,
        total_steps=10,
        eval={"every": 0},
        reward=SEVENS,
        rollout={"batch_size": 32},
    )
    for k in (0, 1):
        assert (
            main(["train", str(cfg), f"name=k{k}", f"rollout.async_steps={k}", "runtime.backend=local"]) == 0
        )
    sync, off = _rows(tmp_path / "runs" / "k0"), _rows(tmp_path / "runs" / "k1")
    assert all(m["staleness/max"] == 0 and m["staleness/off_policy_tokens"] == 0 for m in sync.values())
    assert off[1]["staleness/mean"] == 0  # the first batch comes from the starting weights
    for step in range(2, 11):
        assert off[step]["staleness/mean"] == off[step]["staleness/max"] == 1
        assert off[step]["staleness/off_policy_tokens"] == 1
    assert "correction/is_mean" in off[2] and "correction/is_mean" not in sync[2]  # IS on by default
    assert any(abs(m["correction/is_mean"] - 1) > 1e-3 for m in off.values())  # stale tokens reweighted
    gain = {k: (rows[9]["rollout/reward_mean"] + rows[10]["rollout/reward_mean"]) / 2 - rows[1]["rollout/reward_mean"]
            for k, rows in (("sync", sync), ("async", off))}  # fmt: skip
    # measured: 0.031 -> 0.245 (sync) and 0.031 -> 0.242 (async, k=1)
    assert gain["sync"] > 0.1 and gain["async"] > 0.5 * gain["sync"], gain


def test_async_resume_reproduces_the_uninterrupted_run(tmp_path, assets):
    """A checkpoint keeps the generations submitted ahead; the resumed run trains on the same samples."""
    sections = {"checkpoint": {"every": 1, "keep_last": 3}, "eval": {"every": 0}, "reward": SEVENS}
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=4, **sections)
    run = ["train", str(cfg), "rollout.async_steps=2", "runtime.backend=local"]
    assert main([*run, "name=straight"]) == 0
    assert main([*run, "name=stopped", "total_steps=2"]) == 0
    queue = tmp_path / "runs" / "stopped" / "checkpoints" / "step_000002" / "rollout_queue.pt"
    assert queue.exists()
    assert main([*run, "name=stopped", "--resume"]) == 0
    for step in (3, 4):
        straight = step_metrics(tmp_path / "runs" / "straight", step)
        resumed = step_metrics(tmp_path / "runs" / "stopped", step)
        assert straight.keys() == resumed.keys()
        assert resumed["staleness/mean"] == 2
        for key in straight:
            assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-6), (step, key)


def test_async_on_separate_cpu_slots_through_ray(tmp_path, assets):
    """Ray, actor_infer on a pool slot of its own: the run completes one step off-policy."""
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, eval={"every": 0}, reward=SEVENS)
    assert main(["train", str(cfg), "rollout.async_steps=1", *ASYNC_POOL]) == 0
    rows = _rows(tmp_path / "runs" / "t")
    assert [rows[s]["staleness/max"] for s in (1, 2, 3)] == [0, 1, 1]
    assert all(math.isfinite(m["actor/loss"]) for m in rows.values())


def test_async_on_one_device_where_nothing_moves_through_ray(tmp_path, assets, monkeypatch):
    """Ray, every role on one pool slot that none leaves (``placement.offload: never``): the engine
    generates the next batch while the trainers compute, and the weights go over the 'ipc' transport
    ('auto' resolves to it: shared memory on CPUs, CUDA IPC on GPUs), each sync after the generations in
    flight; the run completes one step off-policy. The driver computes the advantages on one torch
    thread (``driver_threads``: on many, each op waited for cores the engine held) and gets its own
    thread count back after the run."""
    import torch

    import reroll.pipelines.rlvr as rlvr
    from reroll.config.loader import load_config
    from reroll.config.placement import weight_sync_transport
    from reroll.config.schema import RunConfig

    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, eval={"every": 0}, reward=SEVENS)
    one = ["rollout.async_steps=1", "placement.devices=1", "placement.offload=never"]
    assert weight_sync_transport(load_config(cfg, RunConfig, one), "cpu") == "ipc"
    threads, advantages, seen = torch.get_num_threads(), rlvr.batch_advantages, []
    monkeypatch.setattr(
        rlvr, "batch_advantages", lambda *a, **k: seen.append(torch.get_num_threads()) or advantages(*a, **k)
    )
    assert main(["train", str(cfg), *one]) == 0
    assert seen == [1, 1, 1] and torch.get_num_threads() == threads
    rows = _rows(tmp_path / "runs" / "t")
    assert [rows[s]["staleness/max"] for s in (1, 2, 3)] == [0, 1, 1]
    assert all(rows[s]["sync/bytes"] > 0 for s in (1, 2))  # pushed after each update but the last
    assert all(math.isfinite(m["actor/loss"]) for m in rows.values())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["placement.devices=1"],
            "roles.actor_infer.devices: rollout.async_steps=1 generates while actor_train",
        ),
        (["rollout.max_staleness=0"], "rollout.max_staleness: (0) is below rollout.async_steps (1)"),
        (  # one device where nothing moves: the weights go over 'ipc', after the generations in flight
            ["placement.devices=1", "placement.offload=never", "rollout.partial_rollouts=true"],
            "rollout.partial_rollouts: weight_sync_transport 'auto' is 'ipc' here",
        ),
        (
            [*ASYNC_POOL, "rollout.weight_sync_transport=ipc"],
            "rollout.weight_sync_transport: 'ipc'",
        ),
    ],
)
def test_async_configs_that_cannot_overlap_are_refused_at_validate(
    tmp_path, assets, capsys, overrides, message
):
    cfg = write_config(tmp_path / "c.yaml", assets)
    assert main(["validate", str(cfg), "rollout.async_steps=1", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_max_staleness_without_async_is_refused(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets)
    assert main(["validate", str(cfg), "rollout.max_staleness=2"]) == 2
    assert "rollout.max_staleness: bounds the staleness of async samples" in capsys.readouterr().err


def test_tail_batching_sets_long_groups_aside_for_a_tail_step(tmp_path, assets):
    """The random tiny model rarely stops: most groups run past 3 tokens; half of each step's groups
    wait, and every third step finishes them (from their tokens, up to 8)."""
    rollout = {"max_new_tokens": 8, "tail_threshold": 3, "tail_share": 0.5}
    sections = {"eval": {"every": 0}, "rollout": rollout, "checkpoint": {"every": 2}}
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, **sections)
    assert main(["train", str(cfg), "runtime.backend=local"]) == 0
    rows = _rows(tmp_path / "runs" / "t")
    assert [rows[s]["tail/step"] for s in (1, 2, 3)] == [0, 0, 1]
    assert rows[1]["tail/deferred_groups"] == rows[2]["tail/deferred_groups"] == 2  # share 0.5 of 4
    assert rows[2]["tail/pending_groups"] == 4 and rows[3]["tail/pending_groups"] == 0
    assert rows[3]["rollout/length_max"] > 3  # continued past the threshold
    assert rows[3]["staleness/max"] >= 1  # the first tokens of the set-aside groups are older
    assert (tmp_path / "runs" / "t" / "checkpoints" / "step_000002" / "rollout_queue.pt").exists()
