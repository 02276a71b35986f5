"""Bad input: one clear message naming the thing and the fix, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from reroll.cli import main
from reroll.errors import UserError
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


def test_cli_prints_no_traceback_and_debug_does(tmp_path, assets, capsys):
    """In this process (a fresh one's exit without a traceback is
    test_bad_input_from_a_fresh_process_has_no_traceback's): ``main`` turns the error into one message and
    exit code 2, and under ``--debug`` lets it through, which ``python -m reroll.cli`` (``sys.exit(main())``)
    prints with its traceback."""
    cfg = write_config(tmp_path / "c.yaml", assets)
    data = yaml.safe_load(cfg.read_text())
    data["rollout"]["temprature"] = 1.0
    cfg.write_text(yaml.safe_dump(data))
    code, err = _run(capsys, "validate", str(cfg))
    assert code == 2
    assert "did you mean 'temperature'" in err and "Traceback" not in err
    with pytest.raises(UserError, match="did you mean 'temperature'"):
        main(["--debug", "validate", str(cfg)])


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


def _bad_input(kind: str, tmp_path) -> tuple[list[str], list[str]]:
    """The overrides that make one bad input, and what its message must say (the file/key, the fix)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    if kind == "not utf-8":
        (bad / "latin1.jsonl").write_bytes(b'{"question": "1+1", "answer": "2"}\n{"question": "caf\xe9"}\n')
        return [f"data.train_files=[{bad / 'latin1.jsonl'}]"], [
            "latin1.jsonl:2",
            "not UTF-8",
            "save the file as UTF-8",
        ]
    if kind == "broken json":
        (bad / "rows.json").write_text('[{"question": "1+1", "answer": "2"},')
        return [f"data.train_files=[{bad / 'rows.json'}]"], [
            "rows.json",
            "not valid JSON at line 1",
            "list of objects",
        ]
    if kind == "jsonl is a directory":
        (bad / "train.jsonl").mkdir()
        return [f"data.train_files=[{bad / 'train.jsonl'}]"], [
            "train.jsonl",
            "is a directory",
            "save_to_disk",
        ]
    if kind == "output_dir below a file":
        (bad / "file").write_text("x")
        return [f"output_dir={bad / 'file' / 'runs'}"], [
            "output_dir",
            "is below",
            "regular file",
            "choose another",
        ]
    if kind == "missing data file":
        return [f"data.eval_files=[{bad / 'test.jsonl'}]"], [
            "data.eval_files[0]",
            "does not exist",
            "fix the path",
        ]
    if kind == "no rows":
        (bad / "empty.jsonl").write_text("\n")
        return [f"data.train_files=[{bad / 'empty.jsonl'}]"], ["empty.jsonl", "has no rows", "add rows"]
    if kind == "rows lack the template's field":
        (bad / "q.jsonl").write_text(json.dumps({"q": "1+1", "answer": "2"}) + "\n")
        return [f"data.train_files=[{bad / 'q.jsonl'}]"], [
            "q.jsonl",
            "no field 'question'",
            "data.prompt_template",
        ]
    if kind == "reward does not import":
        return ["reward.fn=tests.integration.no_such_module:f"], ["reward.fn", "cannot import 'f'"]
    if kind == "reward args it does not take":
        fn = "reward.fn=tests.integration.bad_rewards:with_threshold"
        return [fn, "reward.args={treshold: 2}"], ["reward.args", "'treshold' (did you mean 'threshold'?)"]
    if kind == "max_new_tokens past the context":
        return ["rollout.max_new_tokens=1000000000000"], ["rollout.max_new_tokens", "context length 128"]
    raise AssertionError(kind)


BAD_INPUTS = [
    "not utf-8",
    "broken json",
    "jsonl is a directory",
    "output_dir below a file",
    "missing data file",
    "no rows",
    "rows lack the template's field",
    "reward does not import",
    "reward args it does not take",
    "max_new_tokens past the context",
]


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_input_is_one_message_with_the_fix(tmp_path, assets, capsys, kind, command):
    overrides, expected = _bad_input(kind, tmp_path)
    cfg = write_config(tmp_path / "c.yaml", assets)
    code, err = _run(capsys, command, str(cfg), *overrides)
    assert code == 2, err
    assert err.startswith("error: config ") and "has 1 problem:" in err  # validate and train say the same
    assert all(e in err for e in expected), err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # train stopped before making anything


def test_bad_input_from_a_fresh_process_has_no_traceback(tmp_path, assets):
    overrides, expected = _bad_input("not utf-8", tmp_path)
    cfg = write_config(tmp_path / "c.yaml", assets)
    out = subprocess.run(
        [sys.executable, "-m", "reroll.cli", "train", str(cfg), *overrides], capture_output=True, text=True
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and expected[0] in out.stderr


def test_a_failed_attempt_leaves_an_earlier_run_byte_identical(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets)
    run_dir = tmp_path / "runs" / "t"  # an earlier run that stopped before its first checkpoint
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("# the earlier run's resolved config\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.25}\n{"step": 1}\n')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}

    code, err = _run(capsys, "train", str(cfg), f"data.train_files=[{tmp_path / 'missing.jsonl'}]")
    assert code == 2 and "does not exist" in err  # a bad input: refused before the run directory
    code, err = _run(capsys, "train", str(cfg), "runtime.backend=local")  # a good one: refused, with why
    assert code == 2
    assert "holds an earlier run (config.yaml, metrics.jsonl) with no complete checkpoint to resume" in err
    assert "set name / output_dir" in err and "nothing was overwritten" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
