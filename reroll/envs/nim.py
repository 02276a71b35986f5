"""Nim against a random opponent: the small game the tiny model learns on CPU.

A pile of ``min_pile..max_pile`` stones; the policy and the environment's opponent take turns
removing 1 to ``max_take`` stones; whoever takes the last stone wins. The policy moves first and
answers with one number. Each observation is the pile (``pile 13``), so a turn needs only the last
message; the winning rule (leave a multiple of ``max_take + 1``) is never stated, so it is what RL
has to find. Random play wins about half the episodes; the winning rule about nine in ten (the
opponent moves at random, so even a lost start is often won back). The text uses only
``GAME_ALPHABET``'s characters (``reroll.models.tiny``).
"""

from __future__ import annotations

import random
import re
from typing import Any

_NUMBER = re.compile(r"\s*(\d+)\s*$")


class Nim:
    """Take 1..max_take stones; the last stone wins. Reward 1 for a win, 0 for a loss or an invalid move."""

    def __init__(self, min_pile: int = 5, max_pile: int = 15, max_take: int = 3) -> None:
        if not 1 <= min_pile <= max_pile:
            raise ValueError(f"nim: need 1 <= min_pile ({min_pile}) <= max_pile ({max_pile})")
        if max_take < 2:
            raise ValueError(f"nim: max_take is {max_take}; use 2 or more, or there is no choice to make")
        self.min_pile, self.max_pile, self.max_take = min_pile, max_pile, max_take
        self.pile = 0
        self._rng = random.Random(0)
        self._agent_rng = random.Random(1)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._rng = random.Random(seed)
        self._agent_rng = random.Random(None if seed is None else seed + 1)
        self.pile = self._rng.randint(self.min_pile, self.max_pile)
        return f"pile {self.pile}", {"pile": self.pile}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        m = _NUMBER.match(action)
        take = int(m.group(1)) if m else 0
        if not 1 <= take <= min(self.max_take, self.pile):
            return "invalid", 0.0, True, False, {"success": False, "invalid": True}
        self.pile -= take
        if self.pile == 0:
            return "you win", 1.0, True, False, {"success": True}
        reply = self._rng.randint(1, min(self.max_take, self.pile))
        self.pile -= reply
        if self.pile == 0:
            return "you lose", 0.0, True, False, {"success": False}
        return f"pile {self.pile}", 0.0, False, False, {"pile": self.pile}

    def sample_random_action(self) -> str:
        """A uniformly random legal move."""
        return str(self._agent_rng.randint(1, min(self.max_take, max(self.pile, 1))))

    def scripted_action(self) -> str:
        """The winning rule: leave a multiple of max_take + 1 (take 1 when no move does)."""
        return str(self.pile % (self.max_take + 1) or 1)
