"""Sokoban: push every box onto a goal. Levels are generated solvable by playing backwards.

A level starts solved (boxes on goals) in a walled room with a few inner walls; the player then walks
``reverse_steps`` random moves backwards, pulling a box behind it when it can. Reversing those moves
solves the level, so every generated level has a known solution (``solution``), used by the scripted
policy. The observation is the room in XSB notation (``#`` wall, ``@`` player, ``$`` box, ``.`` goal,
``*`` box on goal, ``+`` player on goal, ``_`` floor) and the moves; an action is ``left``,
``down``, ``right`` or ``up`` (the last one in the text counts).
"""

from __future__ import annotations

import random
import re
from typing import Any

MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
_WORD = re.compile(r"\b(left|down|right|up)\b", re.IGNORECASE)
Cell = tuple[int, int]


class Sokoban:
    """Reward 1 when every box is on a goal (success); truncated after max_steps moves."""

    def __init__(
        self,
        width: int = 6,
        height: int = 6,
        num_boxes: int = 1,
        inner_walls: int = 2,
        reverse_steps: int = 20,
        max_steps: int = 30,
    ) -> None:
        if width < 4 or height < 4:
            raise ValueError(f"sokoban: the room is {width}x{height}; use at least 4x4 (walls included)")
        if num_boxes < 1 or num_boxes > (width - 2) * (height - 2) // 3:
            raise ValueError(f"sokoban: num_boxes is {num_boxes}; use 1..{(width - 2) * (height - 2) // 3}")
        self.width, self.height, self.num_boxes = width, height, num_boxes
        self.inner_walls, self.reverse_steps, self.max_steps = inner_walls, reverse_steps, max_steps
        self.walls: set[Cell] = set()
        self.goals: frozenset[Cell] = frozenset()
        self.boxes: set[Cell] = set()
        self.player: Cell = (1, 1)
        self.solution: list[str] = []
        self.steps = 0
        self._agent_rng = random.Random(1)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self._agent_rng = random.Random(None if seed is None else seed + 1)
        while not self._generate(rng):
            pass
        self.steps = 0
        return self.render(), {}

    def _generate(self, rng: random.Random) -> bool:
        """One attempt at a level: False when the backward walk left a box on its goal."""
        border = {(r, c) for r in range(self.height) for c in range(self.width)}
        border -= {(r, c) for r in range(1, self.height - 1) for c in range(1, self.width - 1)}
        floor = [(r, c) for r in range(1, self.height - 1) for c in range(1, self.width - 1)]
        inner = set(rng.sample(floor, self.inner_walls))
        floor = [p for p in floor if p not in inner]
        if not _connected(set(floor)):
            return False
        self.walls = border | inner
        picked = rng.sample(floor, self.num_boxes + 1)
        self.goals, self.boxes, self.player = frozenset(picked[1:]), set(picked[1:]), picked[0]
        forward: list[str] = []
        for _ in range(self.reverse_steps):
            name = rng.choice(list(MOVES))
            dr, dc = MOVES[name]
            back = (self.player[0] - dr, self.player[1] - dc)
            if back in self.walls or back in self.boxes:
                continue
            ahead = (self.player[0] + dr, self.player[1] + dc)
            if ahead in self.boxes and rng.random() < 0.8:  # pull the box into the player's cell
                self.boxes.remove(ahead)
                self.boxes.add(self.player)
            self.player = back
            forward.append(name)  # undone by moving `name` from `back`, pushing any pulled box
        self.solution = forward[::-1]
        return not (self.boxes & self.goals)

    def render(self) -> str:
        rows = []
        for r in range(self.height):
            row = ""
            for c in range(self.width):
                p = (r, c)
                if p in self.walls:
                    row += "#"
                elif p == self.player:
                    row += "+" if p in self.goals else "@"
                elif p in self.boxes:
                    row += "*" if p in self.goals else "$"
                else:
                    row += "." if p in self.goals else "_"
            rows.append(row)
        return "\n".join(rows) + "\nmove: left, down, right or up"

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        truncated = self.steps >= self.max_steps
        words = _WORD.findall(action)
        if not words:
            return "invalid move; answer left, down, right or up", 0.0, False, truncated, {"invalid": True}
        dr, dc = MOVES[words[-1].lower()]
        ahead = (self.player[0] + dr, self.player[1] + dc)
        beyond = (ahead[0] + dr, ahead[1] + dc)
        if ahead in self.boxes and beyond not in self.walls and beyond not in self.boxes:
            self.boxes.remove(ahead)
            self.boxes.add(beyond)
            self.player = ahead
        elif ahead not in self.walls and ahead not in self.boxes:
            self.player = ahead
        solved = self.boxes == set(self.goals)
        info = {"success": True} if solved else ({"success": False} if truncated else {})
        return self.render(), float(solved), solved, truncated and not solved, info

    def sample_random_action(self) -> str:
        return self._agent_rng.choice(list(MOVES))

    def scripted_action(self) -> str:
        """The generator's solution, one move per step (valid from the start of the episode)."""
        return self.solution[self.steps] if self.steps < len(self.solution) else "up"


def _connected(cells: set[Cell]) -> bool:
    """Whether the cells form one 4-connected region."""
    if not cells:
        return False
    start = next(iter(cells))
    seen, stack = {start}, [start]
    while stack:
        r, c = stack.pop()
        for dr, dc in MOVES.values():
            q = (r + dr, c + dc)
            if q in cells and q not in seen:
                seen.add(q)
                stack.append(q)
    return seen == cells
