"""torch.profiler over one step's work in a worker process (``logging.profile_steps``).

A trainer rank starts recording when the driver begins a profiled step and writes what was recorded
when the step ends: a trace (``<name>.json.gz``, for Perfetto or chrome://tracing) and a table
(``<name>.txt``) of the operators by self device time (on a GPU) and by self host time. The host table
is where a launch-bound model shows itself: its kernels are short and the host's time goes to
launching them, allocating (``cudaMalloc``) and waiting (``cudaStreamSynchronize``).

torch records one profile per process at a time: ranks that share a process (``runtime.backend:
local``) share one recording, written once, by the last of them to stop, under all their names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROWS = 40  # operators per table

_recording: profile | None = None
_step: int | None = None  # the step being recorded
_names: list[str] = []  # the ranks in this process that asked for the recording
_open: set[str] = set()  # those that have not stopped yet


def start(name: str, step: int) -> None:
    """Record this process's work for ``name`` (a rank) in ``step``, joining the recording of the same
    step; one left from an earlier step (that failed before its stop) is dropped."""
    global _recording, _step
    if _recording is not None and _step != step:
        discard()
    if _recording is None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        _recording, _step = profile(activities=activities, record_shapes=True), step
        _recording.start()
        _names.clear()
    _names.append(name)
    _open.add(name)


def stop(directory: Path, name: str) -> list[str]:
    """End ``name``'s part; the last part to end writes ``<names>-step<N>.json.gz`` and ``.txt`` in
    ``directory``. The paths written (none while other ranks of this process still record)."""
    global _recording
    _open.discard(name)
    if _recording is None or _open:
        return []
    prof, _recording = _recording, None
    prof.stop()
    directory.mkdir(parents=True, exist_ok=True)
    base = f"{'+'.join(_names)}-step{_step}"
    trace, table = directory / f"{base}.json.gz", directory / f"{base}.txt"
    prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    parts = []
    if torch.cuda.is_available():
        parts += ["by self device time", events.table(sort_by="self_device_time_total", row_limit=ROWS)]
    parts += ["by self host time", events.table(sort_by="self_cpu_time_total", row_limit=ROWS)]
    table.write_text("\n".join(parts) + "\n")
    return [str(trace), str(table)]


def discard() -> None:
    """Stop a recording without writing it."""
    global _recording
    if _recording is not None:
        prof, _recording = _recording, None
        prof.stop()
    _open.clear()
