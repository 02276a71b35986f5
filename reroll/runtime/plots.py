"""``reroll plot``: curves of one or several runs' ``metrics.jsonl`` as a PNG, without TensorBoard.

One panel per metric, one line per run (named by its directory), step on the x axis. A metric is a
name from ``metrics.jsonl`` or a shell-style pattern (``timing/*``); by default the reward, accuracy
(training and held-out), KL and step time, those of them the runs logged. matplotlib is optional:
``pip install 'reroll[plot]'``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from pathlib import Path

from reroll.errors import UserError
from reroll.packages import importable
from reroll.runtime.metrics import read_metrics

DEFAULT_METRICS = (
    "rollout/reward_mean",
    "rollout/accuracy",
    "eval/accuracy",
    "actor/kl",
    "actor/approx_kl",
    "kl/reward_kl",
    "timing/step",
)


def split_runs_and_metrics(args: Sequence[str]) -> tuple[list[Path], list[str]]:
    """``RUN_DIR ... METRIC ...``: the arguments that are directories are runs, the rest metrics."""
    runs = [Path(a) for a in args if Path(a).is_dir()]
    metrics = [a for a in args if not Path(a).is_dir()]
    if not runs:
        raise UserError(f"plot: none of {list(args)} is a run directory; name at least one (runs/quickstart)")
    for run in runs:
        if not (run / "metrics.jsonl").is_file():
            raise UserError(f"plot: {run} has no metrics.jsonl: name a run directory (where config.yaml is)")
    return runs, metrics


def select_metrics(available: Sequence[str], asked: Sequence[str]) -> list[str]:
    """The metrics to draw, in the order asked (patterns expanded in sorted order); the defaults the runs
    logged when none are asked. An asked name or pattern that matches nothing is an error."""
    if not asked:
        chosen = [m for m in DEFAULT_METRICS if m in available]
        if not chosen:
            raise UserError(
                f"plot: the runs logged none of the default metrics {list(DEFAULT_METRICS)}; name some, "
                f"e.g. {', '.join(sorted(available)[:4])}"
            )
        return chosen
    chosen: list[str] = []
    for pattern in asked:
        found = sorted(m for m in available if fnmatch.fnmatchcase(m, pattern))
        if not found:
            raise UserError(
                f"plot: {pattern!r} is neither a run directory nor a metric of the runs' metrics.jsonl; "
                f"they have {', '.join(sorted(available))}"
            )
        chosen += [m for m in found if m not in chosen]
    return chosen


def plot_runs(runs: Sequence[Path], metrics: Sequence[str], out: Path) -> Path:
    """Draw ``metrics`` (names or patterns; empty: the defaults) of ``runs`` into the PNG ``out`` (a
    directory gets ``curves.png``). Returns the file written."""
    if not importable("matplotlib"):
        raise UserError("reroll plot needs matplotlib: pip install 'reroll[plot]'")
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    rows = {run: read_metrics(run) for run in runs}
    available = sorted({k for rs in rows.values() for r in rs for k in r if k != "step"})
    chosen = select_metrics(available, metrics)
    cols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.5 * nrows), squeeze=False)
    names = _labels(runs)
    for ax, metric in zip(axes.flat, chosen):
        for run, label in zip(runs, names):
            points = [(r["step"], r[metric]) for r in rows[run] if metric in r]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="." if len(points) < 30 else None, label=label)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(chosen) :]:
        ax.axis("off")
    if len(runs) > 1:
        axes.flat[0].legend()
    fig.tight_layout()
    path = out if out.suffix.lower() == ".png" else out / "curves.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _labels(runs: Sequence[Path]) -> list[str]:
    """Each run's directory name, or its path where two runs share a name."""
    names = [run.name for run in runs]
    return [str(run) if names.count(run.name) > 1 else run.name for run in runs]
