"""RLVR's rollout source through the real CLI and Ray: DAPO refills, off-policy (async) training."""

from __future__ import annotations

import pytest

from reroll.cli import main
from reroll.runtime.metrics import read_metrics
from tests.conftest import write_config

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
