"""FrozenLake: walk across a frozen lake to the goal without falling through a hole.

Each seed draws a ``size`` x ``size`` map whose goal is reachable (holes are redrawn until a path
exists). The observation is the grid as text (``P`` you, ``G`` goal, ``H`` hole, ``.`` ice) and the
moves; an action is one of ``left``, ``down``, ``right``, ``up`` (the last one in the text counts).
With ``slippery`` a move goes sideways a third of the time each way, as in Gymnasium's FrozenLake.
"""

from __future__ import annotations

import random
import re
from collections import deque
from typing import Any

MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
_WORD = re.compile(r"\b(left|down|right|up)\b", re.IGNORECASE)


class FrozenLake:
    """Reach G from the top-left corner; reward 1 at the goal, 0 in a hole; truncated after max_steps."""

    def __init__(
        self, size: int = 4, hole_prob: float = 0.2, slippery: bool = False, max_steps: int = 20
    ) -> None:
        if size < 2:
            raise ValueError(f"frozenlake: size is {size}; use 2 or more")
        if not 0 <= hole_prob < 1:
            raise ValueError(f"frozenlake: hole_prob is {hole_prob}; use a value in [0, 1)")
        self.size, self.hole_prob, self.slippery, self.max_steps = size, hole_prob, slippery, max_steps
        self.rng, self._agent_rng = random.Random(0), random.Random(1)
        self.holes: set[tuple[int, int]] = set()
        self.pos, self.goal, self.steps = (0, 0), (size - 1, size - 1), 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.rng = random.Random(seed)
        self._agent_rng = random.Random(None if seed is None else seed + 1)
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        while True:
            self.holes = {
                p for p in cells if p not in ((0, 0), self.goal) and self.rng.random() < self.hole_prob
            }
            if self._path((0, 0)):
                break
        self.pos, self.steps = (0, 0), 0
        return self.render(), {}

    def render(self) -> str:
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                p = (r, c)
                row += "P" if p == self.pos else "G" if p == self.goal else "H" if p in self.holes else "."
            rows.append(row)
        return "\n".join(rows) + "\nmove: left, down, right or up"

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        words = _WORD.findall(action)
        if not words:
            truncated = self.steps >= self.max_steps
            return "invalid move; answer left, down, right or up", 0.0, False, truncated, {"invalid": True}
        move = words[-1].lower()
        if self.slippery:
            names = list(MOVES)
            i = names.index(move)
            move = self.rng.choice([names[(i - 1) % 4], move, names[(i + 1) % 4]])
        dr, dc = MOVES[move]
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if 0 <= r < self.size and 0 <= c < self.size:
            self.pos = (r, c)
        if self.pos == self.goal:
            return self.render(), 1.0, True, False, {"success": True}
        if self.pos in self.holes:
            return self.render(), 0.0, True, False, {"success": False}
        return self.render(), 0.0, False, self.steps >= self.max_steps, {}

    def _path(self, start: tuple[int, int]) -> list[str] | None:
        """The moves of a shortest path from ``start`` to the goal around the holes (None if none)."""
        back: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
        queue = deque([start])
        while queue:
            p = queue.popleft()
            if p == self.goal:
                moves = []
                while back[p] is not None:
                    p, name = back[p]  # type: ignore[misc]
                    moves.append(name)
                return moves[::-1]
            for name, (dr, dc) in MOVES.items():
                q = (p[0] + dr, p[1] + dc)
                if 0 <= q[0] < self.size and 0 <= q[1] < self.size and q not in self.holes and q not in back:
                    back[q] = (p, name)
                    queue.append(q)
        return None

    def sample_random_action(self) -> str:
        return self._agent_rng.choice(list(MOVES))

    def scripted_action(self) -> str:
        """The first move of a shortest path to the goal."""
        path = self._path(self.pos)
        return path[0] if path else "left"
