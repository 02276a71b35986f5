"""Failures during a run stop it early and clearly, and lose nothing already written: a reward that
always raises, a loss that is never finite, a disk that fills mid-checkpoint, a resumed run that fails
before its first step."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path

import pytest
import torch

from reroll.cli import main
from reroll.runtime import checkpoint
from reroll.runtime.metrics import read_metrics
from tests.conftest import write_config

pytestmark = pytest.mark.integration

LOCAL = ("runtime.backend=local", "eval.every=0")
RAISES = "reward.fn=tests.integration.bad_rewards:type_error_unless_right"  # passes validate's calls


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_reward_raising_on_every_call_stops_at_step_1(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=200)
    code = main(["train", str(cfg), *LOCAL, RAISES, "data.eval_files=[]"])
    err = capsys.readouterr().err
    assert code == 2  # the user's function is wrong
    assert "the reward failed on 16 of 16 samples during reward at step 1" in err
    assert "reward.fn 'tests.integration.bad_rewards:type_error_unless_right' raised TypeError: " in err
    assert "unsupported operand type(s) for +: 'int' and 'str'" in err
    assert "Traceback" not in err
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "t")] == [0]  # no step trained on it


def test_a_reward_raising_on_every_call_is_refused_before_anything_starts(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=200)
    raises = "reward.fn=tests.integration.bad_rewards:always_type_error"
    code = main(["train", str(cfg), *LOCAL, raises])
    err = capsys.readouterr().err
    assert (
        code == 2 and "reward.fn: 'tests.integration.bad_rewards:always_type_error' raised TypeError" in err
    )
    assert "bad_rewards.py, line 10, in always_type_error)" in err  # where the user's code raised it
    assert "when called on training row 1 of " in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # refused before the warm start, the run directory or any worker


def test_an_evaluation_where_the_reward_always_raises_stops_before_training(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets)
    code = main(["train", str(cfg), *LOCAL, RAISES])
    err = capsys.readouterr().err
    assert code == 2 and "the reward failed on 16 of 16 samples during evaluate" in err  # eval_limit 16
    assert "raised TypeError: unsupported operand" in err
    assert not (tmp_path / "runs" / "t" / "metrics.jsonl").exists()  # it failed before its first metrics


def test_a_resumed_run_failing_before_its_first_step_leaves_the_run_as_it_was(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=1)
    assert main(["train", str(cfg), *LOCAL]) == 0
    run_dir = tmp_path / "runs" / "t"
    before = _files(run_dir)
    code = main(["train", str(cfg), "--resume", *LOCAL, "total_steps=2", RAISES])
    err = capsys.readouterr().err
    assert code == 2 and "during reward at step 2" in err
    assert _files(run_dir) == before  # config.yaml, metrics.jsonl and the checkpoint, byte for byte


def test_a_nan_loss_is_skipped_counted_and_stops_after_n_in_a_row(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=5)
    nan = "reward.fn=tests.integration.bad_rewards:nan_reward"  # nan rewards -> nan advantages and loss
    code = main(["train", str(cfg), *LOCAL, nan, "optim.max_nonfinite_steps=2", "data.eval_files=[]"])
    err = capsys.readouterr().err
    assert code == 1
    assert (
        "actor_train[0] failed during train at step 2: FloatingPointError: 2 optimizer steps in a row" in err
    )
    assert "(optim.max_nonfinite_steps=2)" in err and "loss nan on a micro-batch of 16 rows" in err
    # the skipped step is logged with its step and the batch's statistics, and counted
    assert "step 1: 1 of 1 optimizer steps skipped for a non-finite loss or gradient" in err
    assert "rewards mean nan" in err
    [step1] = [m for m in read_metrics(tmp_path / "runs" / "t") if m["step"] == 1]
    assert step1["train/nonfinite_skipped"] == 1.0 and math.isnan(step1["actor/grad_norm"])


def test_a_full_disk_mid_checkpoint_keeps_the_previous_checkpoint(tmp_path, assets, capsys, monkeypatch):
    save = torch.save

    def full_disk_at_step_2(obj, path, *args, **kwargs):  # after the model and optimizer are written
        if ".step_000002.partial" in str(path) and Path(path).name == "algorithm_state.pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_at_step_2)
    cfg = write_config(tmp_path / "c.yaml", assets, checkpoint={"every": 1})
    code = main(["train", str(cfg), *LOCAL])
    err = capsys.readouterr().err
    run_dir = tmp_path / "runs" / "t"
    assert code == 2
    assert "checkpoint of step 2 could not be written by the controller: No space left on device" in err
    assert "step_000001 is still the newest complete checkpoint" in err and "--resume" in err
    assert checkpoint.latest(run_dir).name == "step_000001"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"]  # the partial is gone
    assert "Traceback" not in err
