"""Metrics beyond metrics.jsonl: W&B (offline) and MLflow (a local file store), and ``reroll plot``."""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest

from reroll.cli import main
from reroll.runtime.metrics import MetricsLogger, MlflowSettings


def needs(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} not installed")


STEPS = [{"rollout/reward_mean": 0.25, "timing/step": 1.5}, {"rollout/reward_mean": 0.5, "timing/step": 1.25}]


def _log(run_dir, **sinks) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = MetricsLogger(
        run_dir,
        tensorboard=False,
        wandb_project="reroll-test",
        run_name="t",
        config={"optim": {"lr": 1e-3}},
        **sinks,
    )
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()


@needs("mlflow")
def test_mlflow_gets_params_and_metrics_per_step_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this
    uri = (tmp_path / "mlruns").as_uri()
    settings = MlflowSettings("reroll-test", uri)
    _log(tmp_path / "run", wandb=False, mlflow=settings)
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("reroll-test").experiment_id])
    assert run.data.params == {"optim.lr": "0.001"} and run.info.run_name == "t"
    history = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert run.info.status == "FINISHED"

    resumed = MetricsLogger(
        tmp_path / "run", tensorboard=False, wandb=False, wandb_project="", run_name="t", config={},
        resume_step=2, mlflow=settings,
    )  # fmt: skip
    resumed.log(3, {"rollout/reward_mean": 0.75})
    resumed.close()
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the same MLflow run, continued
    history = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert [m.step for m in history] == [1, 2, 3]


@needs("wandb")
def test_wandb_offline_run_records_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "run").mkdir()
    logger = MetricsLogger(
        tmp_path / "run", tensorboard=False, wandb=True, wandb_project="reroll-test", run_name="t",
        config={"optim": {"lr": 1e-3}},
    )  # fmt: skip
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    run = logger._wandb
    assert run.offline and run.name == "t" and run.config["optim"] == {"lr": 1e-3}
    assert run.summary["rollout/reward_mean"] == 0.5 and run.summary["timing/step"] == 1.25
    logger.close()
    [records] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads
    assert records.read_bytes().startswith(b":W&B")


def test_tracker_missing_is_one_message(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in ("wandb", "mlflow") else real(n, *a)
    )
    with pytest.raises(Exception, match=r"pip install 'reroll\[tracking\]'"):
        _log(tmp_path / "a", wandb=True)
    with pytest.raises(Exception, match=r"pip install 'reroll\[mlflow\]'"):
        _log(tmp_path / "b", wandb=False, mlflow=MlflowSettings())


def _write_run(path, rows) -> None:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@needs("matplotlib")
def test_plot_two_runs_side_by_side(tmp_path, capsys):
    rows = lambda scale: [  # noqa: E731
        {"step": s, "rollout/reward_mean": scale * s, "eval/accuracy": 0.1 * s, "actor/kl": 0.01 * s,
         "timing/step": 1.0, "timing/generate": 0.5}
        for s in range(1, 6)
    ]  # fmt: skip
    _write_run(tmp_path / "a", rows(0.1))
    _write_run(tmp_path / "b", rows(0.2))
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    default = tmp_path / "a" / "plots" / "curves.png"
    assert capsys.readouterr().out.strip() == f"wrote {default}"
    width, height = _png_size(default)  # four default metrics the runs logged: 3 columns, 2 rows
    assert (width, height) == (1500, 700)

    out = tmp_path / "timing.png"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "timing/*", "--out", str(out)]) == 0
    assert _png_size(out) == (1000, 350)  # timing/generate and timing/step: one row of two

    assert main(["plot", str(tmp_path / "a"), "no/such"]) == 2
    err = capsys.readouterr().err
    assert "'no/such' is neither a run directory nor a metric" in err and "rollout/reward_mean" in err


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    _write_run(tmp_path / "a", [{"step": 1, "rollout/reward_mean": 0.1}])
    assert main(["plot", str(tmp_path / "a")]) == 2
    assert "pip install 'reroll[plot]'" in capsys.readouterr().err
