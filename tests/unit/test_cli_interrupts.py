"""Ctrl-C and `kill` stop `train` with one line that says what can be continued (a resume hint only
when a checkpoint exists), exit code 130 or 143; `generate` checks only what generating reads."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

from reroll import cli
from reroll.config.loader import ConfigError
from reroll.pipelines import run as run_module
from reroll.runtime import checkpoint
from tests.conftest import write_config


@pytest.fixture
def config(tmp_path, assets, monkeypatch):
    previous = signal.getsignal(signal.SIGTERM)
    yield write_config(tmp_path / "c.yaml", assets)
    signal.signal(signal.SIGTERM, previous)  # main() installs its own for train


def _interrupt_run(monkeypatch, *, signum=signal.SIGINT, writes=None):
    def fake_run(pipeline_cls, cfg, *, resume=False):
        if writes is not None:
            writes(cfg.run_dir)
        if signum == signal.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by main's handler, as `kill PID` is
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run", fake_run)


def test_an_interrupt_before_anything_was_written_says_to_rerun(config, monkeypatch, capsys):
    _interrupt_run(monkeypatch)
    assert cli.main(["train", str(config)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted before the run wrote anything: rerun the same command to start"


def test_an_interrupt_before_the_first_checkpoint_gives_no_resume_hint(config, monkeypatch, capsys):
    def metrics(run_dir):
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("{}\n")

    _interrupt_run(monkeypatch, signum=signal.SIGTERM, writes=metrics)
    assert cli.main(["train", str(config)]) == 143  # SIGTERM: 128 + 15
    err = capsys.readouterr().err
    assert "interrupted before the first checkpoint: nothing to resume; delete " in err
    assert "--resume" not in err


def test_an_interrupt_after_a_checkpoint_names_it_for_resume(config, monkeypatch, capsys):
    _interrupt_run(monkeypatch)
    monkeypatch.setattr(checkpoint, "latest", lambda run_dir: run_dir / "checkpoints" / "step_000050")
    assert cli.main(["train", str(config)]) == 130
    err = capsys.readouterr().err
    assert (
        "interrupted: the last complete checkpoint, " in err
        and "step_000050, can be resumed with --resume" in err
    )


def test_generate_takes_one_response_per_prompt_which_training_with_grpo_refuses(config):
    args = argparse.Namespace(config=config, overrides=["rollout.group_size=1", "algorithm.preset=grpo"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size is 1: set rollout\.group_size to 2 or more"):
        cli._load(args)
    assert cli._load(args, trains=False).rollout.group_size == 1
    args.overrides += ["rollout.batch_size=6", "rollout.group_size=4"]  # what generate reads is still checked
    with pytest.raises(ConfigError, match=r"rollout.batch_size \(6\) must be divisible"):
        cli._load(args, trains=False)
