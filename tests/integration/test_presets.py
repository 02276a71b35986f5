"""Every algorithm preset runs a few RLVR steps through the CLI, and its settings reach the resolved config."""

from __future__ import annotations

import math

import pytest
import yaml

from reroll.cli import main
from reroll.config.algorithm import PRESETS
from reroll.runtime.metrics import read_metrics
from tests.conftest import write_config

pytestmark = pytest.mark.integration

# What a preset needs from the rest of the config to be valid on the tiny task.
EXTRA = {
    "dapo": {"algorithm": {"overlong_buffer_len": 2}},  # responses here are at most 4 tokens
    "ppo": {"critic": {"lr": 1e-3}},
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_runs_through_cli(tmp_path, assets, preset):
    extra = EXTRA.get(preset, {})
    algorithm = {"preset": preset, **extra.get("algorithm", {})}
    sections = {k: v for k, v in extra.items() if k != "algorithm"}
    cfg = write_config(tmp_path / "c.yaml", assets, name=preset, algorithm=algorithm, **sections)
    assert main(["train", str(cfg), "runtime.backend=local", "eval.every=0"]) == 0

    run = tmp_path / "runs" / preset
    resolved = yaml.safe_load((run / "config.yaml").read_text())["algorithm"]
    for key, value in PRESETS[preset].items():
        if key not in algorithm:
            assert resolved[key] == value, key  # expanded, visible, not silently changed
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["actor/loss"]) for r in rows[1:] if "actor/loss" in r)


def test_remax_scores_a_greedy_baseline(tmp_path, assets):
    cfg = write_config(tmp_path / "c.yaml", assets, name="remax", algorithm={"adv_estimator": "remax"})
    assert main(["train", str(cfg), "runtime.backend=local", "eval.every=0"]) == 0
    rows = read_metrics(tmp_path / "runs" / "remax")
    assert all("timing/baseline" in r for r in rows[1:])


def test_step_return_is_rejected_in_rlvr(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, algorithm={"adv_estimator": "step_return"})
    assert main(["validate", str(cfg)]) == 2
    assert "algorithm.adv_estimator: 'step_return' needs per-turn rewards" in capsys.readouterr().err
