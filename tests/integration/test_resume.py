"""A run stopped after step k and resumed gives the same step k+1 as a run that never stopped."""

from __future__ import annotations

import pytest

from reroll.cli import main
from reroll.runtime.metrics import read_metrics
from tests.conftest import step_metrics, write_config

pytestmark = pytest.mark.integration


def test_resume_reproduces_nextstep_metrics(tmp_path, assets):
    sections = {
        "checkpoint": {"every": 1, "keep_last": 3},
        "eval": {"every": 0},
        "sft": {"steps": 3, "batch_size": 16, "lr": 1e-3},
    }
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, **sections)

    assert main(["train", str(cfg), "name=straight"]) == 0
    assert main(["train", str(cfg), "name=stopped", "total_steps=2"]) == 0
    assert main(["train", str(cfg), "name=stopped", "--resume"]) == 0

    straight, resumed = (
        step_metrics(tmp_path / "runs" / "straight", 3),
        step_metrics(tmp_path / "runs" / "stopped", 3),
    )
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-6), key
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "stopped")] == [0, 1, 2, 3]


def test_resume_after_kill(tmp_path, assets):
    """SIGKILL mid-run (possibly mid-checkpoint), then --resume: the run finishes from the last complete checkpoint."""
    import os
    import signal
    import subprocess
    import sys

    cfg = write_config(tmp_path / "c.yaml", assets, name="killed", total_steps=8, checkpoint={"every": 2})
    cmd = [sys.executable, "-m", "reroll.cli", "train", str(cfg), "runtime.backend=local", "eval.every=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step 5/8"):
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    run = tmp_path / "runs" / "killed"
    assert (run / "checkpoints" / "step_000004" / "COMPLETE").exists()

    assert main(["train", str(cfg), "--resume", "runtime.backend=local", "eval.every=0"]) == 0
    assert [m["step"] for m in read_metrics(run)] == list(range(9))  # no step lost, none twice
    assert (run / "checkpoints" / "step_000008" / "COMPLETE").exists()
