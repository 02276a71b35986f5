"""Bad input: one clear message naming the thing and the fix, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from reroll.cli import main
from tests.conftest import write_config

pytestmark = pytest.mark.integration


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def test_misspelled_key_gets_did_you_mean(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, rollout={"batch_size": 16, "grop_size": 4})
    code, err = _run(capsys, "validate", str(cfg))
    assert code == 2
    assert "rollout.grop_size: unknown key; did you mean 'group_size'?" in err


def test_wrong_type_and_all_problems_at_once(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, optim={"lr": "fast", "micro_batch_size": 0})
    code, err = _run(capsys, "validate", str(cfg))
    assert code == 2
    assert "optim.lr: expected a number, got 'fast'" in err
    assert "optim.micro_batch_size: must be >= 1, got 0" in err


def test_batch_not_divisible_by_group(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, rollout={"batch_size": 10, "group_size": 4})
    code, err = _run(capsys, "validate", str(cfg))
    assert code == 2
    assert "rollout.batch_size (10) must be divisible by rollout.group_size (4)" in err


def test_model_path_missing(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets, model={"path": str(tmp_path / "no-model")})
    code, err = _run(capsys, "validate", str(cfg))
    assert code == 2
    assert "model.path" in err and "no-model" in err and "build_tiny" in err


def test_override_typo_points_at_command_line(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets)
    code, err = _run(capsys, "validate", str(cfg), "optim.lrr=1e-4")
    assert code == 2
    assert "did you mean 'lr'" in err and "command line" in err


def test_missing_dataset_file(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets)
    code, err = _run(capsys, "train", str(cfg), f"data.train_files=[{tmp_path / 'missing.jsonl'}]")
    assert code == 2
    assert "missing.jsonl" in err and "does not exist" in err


def test_row_without_answer(tmp_path, assets, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "1+1", "answer": "2"}) + "\n" + json.dumps({"question": "2+2"}) + "\n"
    )
    cfg = write_config(tmp_path / "c.yaml", assets)
    code, err = _run(capsys, "train", str(cfg), f"data.train_files=[{bad}]")
    assert code == 2
    assert "row 2" in err and "'answer'" in err


def test_existing_run_is_not_overwritten(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets)
    ckpt = tmp_path / "runs" / "t" / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text("")
    code, err = _run(capsys, "train", str(cfg))
    assert code == 2
    assert "--resume" in err and "nothing was overwritten" in err


def test_cli_prints_no_traceback_and_debug_does(tmp_path, assets):
    cfg = write_config(tmp_path / "c.yaml", assets)
    data = yaml.safe_load(cfg.read_text())
    data["rollout"]["temprature"] = 1.0
    cfg.write_text(yaml.safe_dump(data))
    plain = subprocess.run(
        [sys.executable, "-m", "reroll.cli", "validate", str(cfg)], capture_output=True, text=True
    )
    assert plain.returncode == 2
    assert "did you mean 'temperature'" in plain.stderr and "Traceback" not in plain.stderr
    debug = subprocess.run(
        [sys.executable, "-m", "reroll.cli", "--debug", "validate", str(cfg)], capture_output=True, text=True
    )
    assert "Traceback" in debug.stderr


def test_diverged_run_stops_with_role_and_step(tmp_path, assets, capsys):
    # a reward an untrained model earns sometimes, so the advantages (and the absurd lr) move the weights
    reward = {"fn": "tests.integration.test_ppo_critic:starts_with_digit"}
    cfg = write_config(tmp_path / "c.yaml", assets, optim={"lr": 1e30, "micro_batch_size": 16}, reward=reward)
    code = main(["train", str(cfg), "runtime.backend=local", "eval.every=0"])
    err = capsys.readouterr().err
    assert code == 1
    # lr 1e30 sends the weights to ~1e30 in step 1; the first forward over them fails in step 2, on
    # whichever role runs it first (the engine samples before the trainer's loss check sees a nan)
    assert "failed during generate at step 2" in err and "nan" in err
    assert "Traceback" not in err
