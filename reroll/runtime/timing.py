"""Named, timed phases of a step (``timing/generate``, ``timing/train``, ...); the step's wall time
(``timing/step``) is the run skeleton's, which also counts what no phase covers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """``with timer("generate"): ...`` adds the seconds to ``timing/generate``; ``pop()`` returns and resets."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] = self._seconds.get(phase, 0.0) + time.perf_counter() - start

    def add(self, seconds: dict[str, float]) -> None:
        """Time measured elsewhere, as ``{"phase": seconds}`` (or ``timing/phase`` keys)."""
        for k, v in seconds.items():
            phase = k.removeprefix("timing/")
            self._seconds[phase] = self._seconds.get(phase, 0.0) + v

    def pop(self) -> dict[str, float]:
        out = {f"timing/{k}": v for k, v in self._seconds.items()}
        self._seconds = {}
        return out
