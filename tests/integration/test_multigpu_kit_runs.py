"""``python -m tests.multigpu`` on a machine with fewer than 2 GPUs (this CPU one): it collects the kit
without a GPU, every kit test is skipped with its reason, the table says so and is written to the
given directory, and the exit status is 0 (a skip is not a failure)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.multigpu.kit import gpu_count

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(gpu_count() >= 2, reason="checks the kit where it cannot run: run it instead"),
]


def test_the_kit_runs_here_and_its_table_lists_every_test_skipped_with_the_reason(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tests.multigpu", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "table.txt").read_text()
    assert text in done.stdout  # printed and written
    kit = sorted(p.name for p in (ROOT / "tests" / "multigpu").glob("test_*.py"))
    assert len(kit) >= 6
    rows = [line for line in text.splitlines() if line.startswith("multigpu/")]
    assert (
        sorted({row.split("::")[0].removeprefix("multigpu/") for row in rows}) == kit
    )  # each file, collected
    reason = f"skipped: needs 2 CUDA GPUs, this machine has {gpu_count()}"
    assert all(f"| 2    | {reason}" in row for row in rows), rows
    assert "passed" not in text and "failed" not in text
    assert not (tmp_path / "numbers.jsonl").exists()  # nothing ran, nothing measured
