"""The multi-GPU acceptance kit's runner: every test marked ``multigpu`` (``tests/multigpu`` and the
Megatron ones in ``tests/gpu``), then one table of what each needs, how it ended and what it measured.

    python -m tests.multigpu [--out DIR] [PYTEST ARGS...]      # or: make multigpu

A test says how many GPUs it needs with ``needs_gpus(n)`` (``pytest.mark.multigpu(gpus=n)`` and a
skip below ``n``) and records its numbers with the ``kit_record`` fixture (tests/conftest.py): one JSON
line each, ``{"test": nodeid, "name": ..., "value": ..., "unit": ...}``, in the file that
``KIT_RESULTS`` names (the runner sets it; without it the numbers are only logged). The runner runs
pytest in this process with a plugin that notes each test's outcome, then joins the two into the table,
which it prints and writes to ``DIR/table.txt`` (default ``runs/multigpu-kit``; the numbers stay in
``DIR/numbers.jsonl``). On a machine with fewer GPUs than a test needs, the test is skipped and its row
says why: on a CPU machine the whole table is skips. Exit status: 1 if any test failed, else 0.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

log = logging.getLogger(__name__)

RESULTS_ENV = "KIT_RESULTS"  # the JSON lines file the tests' numbers go to
PATHS = ("tests/multigpu", "tests/gpu")  # where the kit's tests are collected (by marker)
ROOT = Path(__file__).resolve().parents[2]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def needs_gpus(n: int) -> list[pytest.MarkDecorator]:
    """The marks of a kit test that needs ``n`` CUDA GPUs: ``multigpu(gpus=n)`` (the table's column) and
    a skip, with the count found, on a machine with fewer."""
    found = gpu_count()
    return [
        pytest.mark.multigpu(gpus=n),
        pytest.mark.skipif(found < n, reason=f"needs {n} CUDA GPUs, this machine has {found}"),
    ]


def recorder(test: str) -> Callable[..., None]:
    """``record(name, value, unit="")`` for the test ``test`` (a pytest node id): a line in the file
    ``KIT_RESULTS`` names, and a log line."""

    def record(name: str, value: float, unit: str = "") -> None:
        log.info("kit: %s %s = %.4g %s", test, name, value, unit)
        path = os.environ.get(RESULTS_ENV)
        if path:
            line = {"test": test, "name": name, "value": float(value), "unit": unit}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    return record


@dataclass
class Outcome:
    """How one kit test ended."""

    test: str  # pytest node id
    gpus: int | None  # from its multigpu(gpus=n) mark; None where the mark gives none
    result: str = "not run"  # passed | failed | skipped | error | not run
    reason: str = ""  # the skip's reason or the failure's first line
    seconds: float = 0.0
    numbers: list[dict[str, Any]] = field(default_factory=list)


class Collector:
    """A pytest plugin that notes each collected test's GPU count and outcome."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Outcome] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:  # what is left after the -m selection
            self.outcomes[item.nodeid] = Outcome(item.nodeid, gpus_needed(item))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        out = self.outcomes.get(report.nodeid)
        if out is None:
            return
        out.seconds += report.duration
        if report.skipped:
            out.result, out.reason = "skipped", _skip_reason(report)
        elif report.failed:
            out.result = "failed" if report.when == "call" else "error"
            out.reason = _failure_line(report)
        elif report.when == "call" and out.result == "not run":
            out.result = "passed"


COUNTS = {"two": 2, "four": 4, "eight": 8}


def gpus_needed(item: pytest.Item) -> int | None:
    """The GPUs a kit test needs: its ``multigpu(gpus=n)`` mark's, else the count its skip reason names
    ("needs two GPUs", "needs 4 CUDA GPUs"); None where neither says."""
    mark = item.get_closest_marker("multigpu")
    if mark is not None and "gpus" in mark.kwargs:
        return int(mark.kwargs["gpus"])
    for skip in item.iter_markers("skipif"):
        found = re.search(r"needs (\d+|two|four|eight) (?:CUDA )?GPUs", str(skip.kwargs.get("reason", "")))
        if found:
            return COUNTS.get(found[1]) or int(found[1])
    return None


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _failure_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0] if text.strip() else "failed"


def read_numbers(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The recorded numbers by test node id (a file the tests never wrote to: none)."""
    numbers: dict[str, list[dict[str, Any]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                numbers.setdefault(row["test"], []).append(row)
    return numbers


def _measured(numbers: Sequence[dict[str, Any]]) -> str:
    return "; ".join(f"{n['name']} {n['value']:.4g}{' ' + n['unit'] if n['unit'] else ''}" for n in numbers)


def table(outcomes: Sequence[Outcome], header: Sequence[str] = ()) -> str:
    """The kit's table: one row per test (test, GPUs needed, result with its reason, measured numbers,
    seconds), under ``header`` lines; then a count of each result."""
    rows = [("test", "GPUs", "result", "measured", "s")]
    for o in outcomes:
        result = f"{o.result}: {o.reason}" if o.reason else o.result
        gpus = str(o.gpus) if o.gpus is not None else "?"
        rows.append(
            (o.test.removeprefix("tests/"), gpus, result, _measured(o.numbers) or "-", f"{o.seconds:.0f}")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [*header, ""] if header else []
    for i, row in enumerate(rows):
        lines.append(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths))
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.result] = counts.get(o.result, 0) + 1
    lines += ["", ", ".join(f"{n} {r}" for r, n in sorted(counts.items())) or "no kit test collected"]
    return "\n".join(lines)


def machine_lines() -> list[str]:
    """Where the kit ran: time, commit, host, GPUs, torch and the engines' versions."""
    import importlib.metadata

    import torch

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        commit = ""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    names = ", ".join(sorted(set(gpus))) if gpus else "none"
    return [
        f"reroll multi-GPU kit, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit or '?'}",
        f"host {platform.node()}: {len(gpus)} CUDA GPUs ({names}); torch {torch.__version__}, "
        f"vllm {version('vllm')}, megatron-core {version('megatron-core')}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the kit (arguments past ``--out DIR`` go to pytest: ``-k fsdp2``, ``-x``) and print its table."""
    args = list(sys.argv[1:] if argv is None else argv)
    out = ROOT / "runs" / "multigpu-kit"
    if "--out" in args:
        i = args.index("--out")
        out = Path(args[i + 1])
        del args[i : i + 2]
    out.mkdir(parents=True, exist_ok=True)
    numbers_path = out / "numbers.jsonl"
    numbers_path.unlink(missing_ok=True)
    os.environ[RESULTS_ENV] = str(numbers_path)
    collector = Collector()
    paths = [str(ROOT / p) for p in PATHS]
    code = pytest.main(
        [*paths, "-m", "multigpu", "-p", "no:cacheprovider", "-q", "--rootdir", str(ROOT), *args],
        plugins=[collector],
    )
    numbers = read_numbers(numbers_path)
    for test, rows in numbers.items():
        collector.outcomes.setdefault(test, Outcome(test, None)).numbers = rows
    text = table(list(collector.outcomes.values()), machine_lines())
    (out / "table.txt").write_text(text + "\n")
    print(f"\n{text}\n\n(table written to {out / 'table.txt'}, numbers to {numbers_path})")
    failed = any(o.result in ("failed", "error") for o in collector.outcomes.values())
    return 1 if failed or code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) else 0
