"""A run stopped after step k and resumed gives the same step k+1 as a run that never stopped."""

from __future__ import annotations

import pytest

from reroll.cli import main
from reroll.runtime.metrics import read_metrics
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def _step(run_dir, step):
    [row] = [m for m in read_metrics(run_dir) if m["step"] == step]
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "engine/"))}


def test_resume_reproduces_next_step(tmp_path, assets):
    sections = {
        "checkpoint": {"every": 1, "keep_last": 3},
        "eval": {"every": 0},
        "sft": {"steps": 3, "batch_size": 16, "lr": 1e-3},
    }
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=3, **sections)

    assert main(["train", str(cfg), "name=straight"]) == 0
    assert main(["train", str(cfg), "name=stopped", "total_steps=2"]) == 0
    assert main(["train", str(cfg), "name=stopped", "--resume"]) == 0

    straight, resumed = _step(tmp_path / "runs" / "straight", 3), _step(tmp_path / "runs" / "stopped", 3)
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-6), key
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "stopped")] == [0, 1, 2, 3]
