"""A run writes nothing into its directory before its first metrics, and a new run never overwrites an
earlier one's files: it refuses, saying why."""

import json

import pytest

from reroll.config.schema import RunConfig
from reroll.errors import UserError
from reroll.pipelines.run_dir import open_metrics, open_run_dir


def _cfg(tmp_path, **over) -> RunConfig:
    data = {
        "pipeline": "rlvr",
        "name": "r",
        "output_dir": str(tmp_path / "runs" / "{name}"),
        "model": {"path": "org/model"},
        "data": {"train_files": ["train.jsonl"]},
        "logging": {"tensorboard": False},
    }
    return RunConfig.model_validate(data | over)


def _earlier_run(cfg: RunConfig) -> dict[str, bytes]:
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text("# the earlier run's config\n")
    (cfg.run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(3)))
    return {p.name: p.read_bytes() for p in cfg.run_dir.iterdir()}


def test_a_new_run_refuses_a_directory_with_an_earlier_run(tmp_path):
    cfg = _cfg(tmp_path)
    before = _earlier_run(cfg)
    with pytest.raises(UserError) as e:
        open_run_dir(cfg, resume=False)
    message = str(e.value)
    assert "holds an earlier run (config.yaml, metrics.jsonl)" in message
    assert "set name / output_dir" in message and "nothing was overwritten" in message
    assert {p.name: p.read_bytes() for p in cfg.run_dir.iterdir()} == before


def test_nothing_is_written_before_the_first_metrics(tmp_path):
    cfg = _cfg(tmp_path)
    _, run_dir = open_run_dir(cfg, resume=False)
    metrics = open_metrics(cfg, resume_step=None)
    assert list(run_dir.iterdir()) == []  # a run failing here leaves nothing
    metrics.log(0, {"eval/accuracy": 0.5})
    metrics.close()
    assert (run_dir / "config.yaml").read_text().startswith("# resolved RLVRConfig")
    assert json.loads((run_dir / "metrics.jsonl").read_text()) == {"step": 0, "eval/accuracy": 0.5}


def test_a_resumed_run_keeps_the_files_until_its_first_metrics(tmp_path):
    cfg = _cfg(tmp_path)
    before = _earlier_run(cfg)
    metrics = open_metrics(cfg, resume_step=1)  # resuming from the step-1 checkpoint
    metrics.close()  # failed before its first step: the earlier files are as they were
    assert {p.name: p.read_bytes() for p in cfg.run_dir.iterdir()} == before
    metrics = open_metrics(cfg, resume_step=1)
    metrics.log(2, {"x": 1.0})
    metrics.close()
    steps = [json.loads(line)["step"] for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # the lines after the checkpoint's step are replaced


def test_output_dir_below_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = _cfg(tmp_path, output_dir=str(tmp_path / "file" / "{name}"))
    with pytest.raises(UserError, match="output_dir: cannot make the run directory"):
        open_run_dir(cfg, resume=False)
