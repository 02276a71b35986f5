"""Workers for test_recovery: one that answers and one that hangs in a function with a findable name."""

from __future__ import annotations

import time


class Sleeper:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def ping(self) -> int:
        return self.rank

    def hang_in_a_named_function(self, seconds: float) -> None:
        time.sleep(seconds)
