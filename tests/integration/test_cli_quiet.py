"""Quiet by default: third-party notices that say nothing about the user's run are hidden, ``--verbose``
shows them; a closed pipe ends the command without a traceback; usage and override errors that help."""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from reroll.cli import main
from tests.conftest import reroll_cli, write_config

pytestmark = pytest.mark.integration

DEEPSPEED_NOTICE = "Setting accelerator to CPU"
RAY_AUTH = "ray._private.authentication.authentication_token_setup"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_tiny_model_build_is_quiet_and_verbose_brings_deepspeed_back(tmp_path):
    # save_pretrained imports deepspeed through accelerate wherever it is installed: on a machine
    # without a GPU it logged its accelerator detection, and the tiny kit showed a progress bar
    args = ["make-tiny-model", "--hidden-size", "64", "--num-heads", "2", "--num-layers", "1"]
    quiet = reroll_cli(*args, tmp_path / "a")
    assert quiet.returncode == 0, quiet.stderr
    out = quiet.stdout + quiet.stderr
    assert DEEPSPEED_NOTICE not in out and "Writing model shards" not in out
    assert out.strip() == f"tiny model written to {tmp_path / 'a'}"

    verbose = reroll_cli("--verbose", *args, tmp_path / "b")
    assert verbose.returncode == 0, verbose.stderr
    if not _has_gpu():
        assert DEEPSPEED_NOTICE in verbose.stdout + verbose.stderr


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def test_filters_follow_the_verbose_choice(monkeypatch):
    from reroll.runtime import quiet

    record = logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, DEEPSPEED_NOTICE + ".", (), None)
    auth = logging.LogRecord(RAY_AUTH, logging.WARNING, __file__, 1, "Token authentication is enabled for this Ray cluster.", (), None)  # fmt: skip
    disabled = logging.LogRecord(RAY_AUTH, logging.WARNING, __file__, 1, "Token authentication is disabled for this Ray cluster.", (), None)  # fmt: skip
    ds, ray_auth = logging.getLogger("DeepSpeed"), logging.getLogger(RAY_AUTH)
    monkeypatch.setenv(quiet.ENV, "0")
    quiet.configure(False)
    assert not ds.filter(record) and not ray_auth.filter(auth)
    assert ray_auth.filter(disabled)  # the security warning stays
    assert quiet.vllm_logging_level() == "ERROR" or "VLLM_LOGGING_LEVEL" in os.environ
    assert quiet.ray_runtime_env()["env_vars"][quiet.ENV] == "0"
    quiet.allow_deepspeed_notice()  # a DeepSpeed worker
    assert ds.filter(record)
    quiet.configure(True)
    assert ds.filter(record) and ray_auth.filter(auth)
    assert quiet.ray_runtime_env()["env_vars"][quiet.ENV] == "1"
    quiet.configure(False)


def test_closed_pipe_ends_without_traceback():
    # `reroll config-docs | head -5`: the reader leaves while the command still writes. A 4 KiB pipe
    # makes the write block until the reader has closed its end, every time.
    read, write = os.pipe()
    fcntl.fcntl(read, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen(
        [sys.executable, "-m", "reroll.cli", "config-docs"], stdout=write, stderr=subprocess.PIPE, text=True
    )
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        assert reader.read(200).startswith(b"# `RunConfig` reference")
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141  # 128 + SIGPIPE, as a program the pipe stopped
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == ""


def test_validate_usage_shows_overrides_optional(capsys):
    with pytest.raises(SystemExit) as e:
        main(["validate"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: reroll validate [-h] config [KEY=VALUE ...]" in err
    assert "the following arguments are required: config\n" in err  # not "config, overrides"


def test_override_read_as_a_mapping_says_to_quote_it(tmp_path, assets, capsys):
    cfg = write_config(tmp_path / "c.yaml", assets)
    assert main(["validate", str(cfg), "data.prompt_template={question}"]) == 2
    err = capsys.readouterr().err
    assert "'{question}' reads as a YAML mapping" in err
    assert """'data.prompt_template="{question}"'""" in err
    # a key the file does not set: pydantic's type error gets the same hint
    assert main(["validate", str(cfg), "data.id_field={qid}"]) == 2
    err = capsys.readouterr().err
    assert "expected a string, got {'qid': None}" in err and """'data.id_field="{qid}"'""" in err
    # quoted as the hint says, it is the text
    assert main(["validate", str(cfg), 'data.prompt_template="{question}="']) == 0


def test_a_ray_run_logged_to_a_file_is_plain_says_failures_once_and_stops_cleanly_on_sigterm(
    tmp_path, assets
):
    """Output to a file (not a terminal): Ray's worker lines have no colour codes; a reward failing on
    part of the samples is said once with its traceback's file and counted on every step line; `kill`
    stops the run without Ray's native crash dump, naming the checkpoint to resume."""
    cfg = write_config(tmp_path / "c.yaml", assets, total_steps=50, checkpoint={"every": 1})
    log = tmp_path / "out.log"
    overrides = ["reward.fn=tests.integration.bad_rewards:fails_on_odd_lengths", "reward.max_error_share=1.0"]
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "reroll.cli", "train", str(cfg), "eval.every=0", *overrides],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while "step 2/50" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    out = log.read_text()
    assert "step 2/50" in out, out  # the run was under way when it was stopped
    assert code == 143, out
    assert "(RewardWorker pid=" in out and "reward process ready" in out  # a worker's line came through
    assert "\x1b[" not in out  # without colour codes
    steps = [ln for ln in out.splitlines() if ln.startswith("step ") and not ln.startswith("step 0/")]
    assert steps and all(" | rew_err " in ln for ln in steps), steps
    said = [ln for ln in out.splitlines() if ln.startswith("reward: ")]
    assert (
        len(said) == 1 and "raised ValueError: odd length" in said[0] and "bad_rewards.py, line " in said[0]
    )
    errors = tmp_path / "runs" / "t" / "reward_errors.txt"
    assert f"the traceback: {errors}" in said[0] and "Traceback (most recent call last)" in errors.read_text()
    assert "SIGTERM received" not in out and "Traceback" not in out
    assert "interrupted: the last complete checkpoint, " in out and "can be resumed with --resume" in out
