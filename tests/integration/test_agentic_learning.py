"""examples/agentic/nim.yaml through the real CLI: RL lifts held-out success on Nim well above the warm start.

The warm start imitates random legal play, so it knows the format and not the strategy; GRPO over
whole episodes (8 per seed, reward 1 for a win) has to find the winning rule. Numbers in the README.

The bar is 15 points: the greedy evaluation moves between plateaus (0.58, 0.63, 0.73, 0.80), and a change
that moves the training only by float rounding moves the last one. Measured 2026-12-05, seeds 0 / 1 / 2,
before and after the head was restricted to the response positions (same values up to rounding):
0.42 -> 0.77 / 0.73 / 0.81 and 0.42 -> 0.60 / 0.80 / 0.81, gains of 18 to 39 points.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from reroll.runtime.metrics import read_metrics
from tests.conftest import reroll_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long]
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "agentic" / "nim.yaml"


def test_nim_success_rises_by_fifteen_points(tmp_path):
    overrides = [
        f"output_dir={tmp_path}/{{name}}",
        f"model.path={tmp_path}/tiny-game",
        "runtime.backend=local",  # one process: no actor start-up on two cores
        "checkpoint.every=0",
    ]
    start = time.monotonic()
    out = reroll_cli("train", CONFIG, *overrides, timeout=1200)
    minutes = (time.monotonic() - start) / 60
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: agentic-nim | held-out accuracy" in out.stdout
    rows = read_metrics(tmp_path / "agentic-nim")
    before, after = rows[0]["eval/success"], rows[-1]["eval/success"]
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 80
    assert after - before >= 0.15, (before, after, minutes)
    assert minutes < 15, minutes
