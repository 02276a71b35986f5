"""The rise of this process's peak resident memory over a call (Linux ``/proc/self/status``), for the
benchmarks that measure host memory: ``VmHWM`` is reset to ``VmRSS`` through ``/proc/self/clear_refs``
before the call and read after it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``), KiB."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def peak_rise(call: Callable[[], T]) -> tuple[T, float, int]:
    """``call()``'s result, its seconds and the rise of the peak resident memory above the resident
    memory before it, bytes."""
    Path("/proc/self/clear_refs").write_text("5")  # peak resident memory := resident memory now
    before = status_kib("VmRSS")
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    return result, seconds, (status_kib("VmHWM") - before) * 1024
