"""``--checkpoint`` of generate and serve: a model directory, a checkpoint, or a run directory's latest."""

from __future__ import annotations

import pytest

from reroll.errors import UserError
from reroll.runtime import checkpoint
from reroll.runtime.checkpoint import model_dir


def test_checkpoint_model_finds_the_model_directory(tmp_path):
    run = tmp_path / "runs" / "q"
    for step in (10, 20):
        partial = checkpoint.begin(run, step)
        (partial / "model").mkdir()
        (partial / "model" / "config.json").write_text("{}")
        checkpoint.commit(partial, {"step": step})
    latest = run / "checkpoints" / "step_000020"
    assert model_dir(run) == latest / "model"  # a run directory: its latest complete checkpoint
    assert model_dir(run / "checkpoints" / "step_000010") == run / "checkpoints" / "step_000010" / "model"
    assert model_dir(latest / "model") == latest / "model"
    with pytest.raises(
        UserError, match=r"--checkpoint .*empty: no model there .*give a run's checkpoints/step_XXXXXX"
    ):
        model_dir(tmp_path / "empty")
