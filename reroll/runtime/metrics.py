"""Metrics sinks: one JSONL line per step in the run directory, TensorBoard, and W&B when asked for."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reroll.errors import UserError

log = logging.getLogger(__name__)


class MetricsLogger:
    """Writes ``metrics.jsonl`` (append; on resume, lines after the checkpoint's step are dropped)."""

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
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError as e:
                raise UserError(
                    "logging.wandb is true but wandb is not installed: pip install 'reroll[tracking]'"
                ) from e
            self._wandb = wandb_lib.init(
                project=wandb_project, name=run_name, config=dict(config), resume="allow"
            )

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= step
        ]
        self.path.write_text("".join(ln + "\n" for ln in kept))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, float(v), step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """Every line of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]
