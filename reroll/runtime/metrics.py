"""Metrics sinks: one JSONL line per step in the run directory, TensorBoard, and W&B when asked for."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from reroll.errors import UserError

log = logging.getLogger(__name__)


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
    ) -> None:
        if wandb and importlib.util.find_spec("wandb") is None:
            raise UserError(
                "logging.wandb is true but wandb is not installed: pip install 'reroll[tracking]'"
            )
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
            self._wandb.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """Every line of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]
