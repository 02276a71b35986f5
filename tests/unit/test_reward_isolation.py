"""Process isolation of reward calls: a hung call's process is killed, failures are counted, work goes on."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from reroll.config.reward import RewardConfig
from reroll.data.types import RewardItem
from reroll.rewards.base import RewardResult
from reroll.rewards.routing import domain_metrics
from reroll.roles.reward import RewardWorker

M = "isolated_rewards"  # tests/unit/isolated_rewards.py: a light module, quick to import in a child


@pytest.fixture
def worker(tmp_path):
    pid_file = tmp_path / "pid"
    cfg = RewardConfig(
        threads=2,
        sample_timeout_s=0.4,
        error_score=-1.0,
        domains={
            "hang": {"rewards": [{"fn": f"{M}:forever", "args": {"pid_file": str(pid_file)}}]},
            "bug": {"rewards": [{"fn": f"{M}:crash"}]},
            "die": {"rewards": [{"fn": f"{M}:die"}]},
            "ok": {"rewards": [{"fn": f"{M}:whoami"}]},
            "here": {"rewards": [{"fn": f"{M}:whoami", "isolation": "thread"}]},
        },
    )
    w = RewardWorker(0, cfg)
    yield w, pid_file
    w.close()


def test_hung_reward_process_is_killed_within_its_timeout(worker):
    w, pid_file = worker
    start = time.monotonic()
    [hung, ok] = w.score([RewardItem("p", "r", {}, "hang"), RewardItem("p", "abc", {}, "ok")])
    elapsed = time.monotonic() - start
    assert 0.4 <= elapsed < 0.4 + 0.5  # the deadline, plus at most the grace for the kill
    assert hung == RewardResult(-1.0, {"reward_error": 0, "reward_timeout": 1, "correct": 0})
    assert ok.score == 3.0 and ok.details["pid"] != os.getpid()  # ran in a child process
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid)  # killed and reaped, not left spinning
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_raising_and_dying_rewards_are_counted_and_the_worker_goes_on(worker):
    w, _ = worker
    items = [RewardItem("p", "r", {}, tag) for tag in ("bug", "die", "ok", "here")]
    results = w.score(items)
    assert [r.score for r in results] == [-1.0, -1.0, 1.0, 1.0]
    assert results[3].details["pid"] == os.getpid()  # isolation: thread runs in the worker itself
    m = domain_metrics([it.domain for it in items], results)
    assert (m["reward/errors"], m["reward/timeouts"]) == (2.0, 0.0)
    assert (m["reward/bug/reward_errors"], m["reward/die/reward_errors"], m["reward/ok/reward_errors"]) == (
        1.0,
        1.0,
        0.0,
    )
    # The next call is served: the dead child was replaced.
    again = w.score([RewardItem("p", "xy", {}, "ok")] * 4)
    assert [r.score for r in again] == [2.0] * 4
    assert len({r.details["pid"] for r in again} - {os.getpid()}) >= 1


def test_timeouts_are_counted_per_domain(worker):
    w, _ = worker
    items = [
        RewardItem("p", "r", {}, "hang"),
        RewardItem("p", "r", {}, "hang"),
        RewardItem("p", "r", {}, "ok"),
    ]
    m = domain_metrics([it.domain for it in items], w.score(items))
    assert (m["reward/timeouts"], m["reward/hang/reward_timeouts"], m["reward/ok/reward_timeouts"]) == (
        2.0,
        2.0,
        0.0,
    )
    assert "reward/hang/reward_timeout" not in m  # no mean taken over only the failed calls
