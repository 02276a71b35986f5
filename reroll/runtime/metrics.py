"""Metrics sinks: one JSONL line per step in the run directory, TensorBoard, and W&B or MLflow when asked for."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from reroll.errors import UserError
from reroll.packages import importable

log = logging.getLogger(__name__)


def tracker_missing(*, wandb: bool, mlflow: bool) -> list[tuple[str, str]]:
    """``(config key, message with the install line)`` for each tracker asked for but not installed."""
    out = []
    if wandb and not importable("wandb"):
        out.append(
            (
                "logging.wandb",
                "logging.wandb is true but wandb is not installed: pip install 'reroll[tracking]'",
            )
        )
    if mlflow and not importable("mlflow"):
        out.append(
            (
                "logging.mlflow",
                "logging.mlflow is true but mlflow is not installed: pip install 'reroll[mlflow]' (or "
                "'reroll[tracking]' for the client of a tracking server)",
            )
        )
    return out


class MetricsLogger:
    """Writes ``metrics.jsonl`` (append; on resume, lines after the checkpoint's step are dropped).

    Nothing is written until the first ``log``: then ``on_open`` runs (the run writes its resolved
    config), the file is prepared and the TensorBoard / W&B sinks start. A run that fails before its
    first metrics leaves an existing run directory's files untouched."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool,
        wandb: bool,
        wandb_project: str,
        run_name: str,
        config: Mapping[str, Any],
        resume_step: int | None = None,
        on_open: Callable[[], None] | None = None,
        mlflow: MlflowSettings | None = None,
    ) -> None:
        missing = tracker_missing(wandb=wandb, mlflow=mlflow is not None)
        if missing:
            raise UserError(missing[0][1])
        self._mlflow_settings, self._mlflow = mlflow, None
        self.run_dir, self.path = run_dir, run_dir / "metrics.jsonl"
        self._settings = (tensorboard, wandb, wandb_project, run_name, dict(config))
        self._resume_step, self._on_open = resume_step, on_open
        self._file: IO[str] | None = None
        self._tb = None
        self._wandb = None

    def _open(self) -> IO[str]:
        tensorboard, wandb, wandb_project, run_name, config = self._settings
        if self._on_open is not None:
            self._on_open()
        if self._resume_step is not None:
            self._truncate_after(self._resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if wandb:
            import wandb as wandb_lib

            self._wandb = wandb_lib.init(project=wandb_project, name=run_name, config=config, resume="allow")
        if self._mlflow_settings is not None:
            self._mlflow = MlflowRun.open(self._mlflow_settings, self.run_dir, run_name, config)
        return self._file

    def _truncate_after(self, step: int) -> None:
        """Drop the lines after ``step`` (atomically: a crash leaves the old file or the new one)."""
        if not self.path.exists():
            return
        kept = [
            ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= step
        ]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        os.replace(tmp, self.path)

    def rewind(self, step: int) -> None:
        """Drop the lines after ``step``: the run goes back to it (a recovery from a checkpoint) and
        logs the steps since again. TensorBoard and W&B keep the first rows (they take the new ones too)."""
        if self._file is None:  # nothing written yet
            return
        self._file.close()
        self._truncate_after(step)
        self._file = self.path.open("a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        file = self._file or self._open()
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        file.write(json.dumps(record) + "\n")
        file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, float(v), step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step, commit=True)  # now, not when the next step comes
        if self._mlflow is not None:
            self._mlflow.log(step, metrics)

    def flush(self) -> None:
        """Put what was logged into the files (TensorBoard buffers its events)."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.close()


@dataclass(frozen=True)
class MlflowSettings:
    """Where MLflow runs go: ``tracking_uri`` (None: ``MLFLOW_TRACKING_URI`` or MLflow's default)."""

    experiment: str = "reroll"
    tracking_uri: str | None = None


class MlflowRun:
    """One MLflow run of a reroll run: the resolved config as params, metrics per step. A resumed run
    continues the same MLflow run (its id is kept in the run directory, ``mlflow_run_id``)."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def open(
        cls, settings: MlflowSettings, run_dir: Path, run_name: str, config: Mapping[str, Any]
    ) -> MlflowRun:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        id_file = run_dir / "mlflow_run_id"
        try:
            client = MlflowClient(tracking_uri=settings.tracking_uri)
            if id_file.exists():
                run_id = id_file.read_text().strip()
                client.update_run(run_id, status="RUNNING")
                return cls(client, run_id)
            found = client.get_experiment_by_name(settings.experiment)
            exp_id = found.experiment_id if found else client.create_experiment(settings.experiment)
            run_id = client.create_run(exp_id, run_name=run_name).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per call
                client.log_batch(run_id, params=params[i : i + 100])
        except MlflowException as e:
            raise UserError(
                f"logging.mlflow: cannot open the MLflow store {settings.tracking_uri or '(default)'}: "
                f"{str(e).splitlines()[0]}; set logging.mlflow_tracking_uri (a server 'http://host:5000', "
                f"or 'sqlite:///mlflow.db' with pip install 'reroll[mlflow]')"
            ) from e
        id_file.write_text(run_id)
        return cls(client, run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per call
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """Every line of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]
