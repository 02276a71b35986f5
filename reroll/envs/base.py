"""The environment interface (GEM's), and what an episode step returns.

An environment is any object with

- ``reset(seed=None) -> (observation: str, info: dict)``
- ``step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)``

and optionally ``sample_random_action() -> str`` (GEM's name; the random agent uses it) and
``scripted_action() -> str`` (a hand-written policy for the current state, used by ``reroll
env-check --policy scripted`` and for warm-start trajectories). ``info["success"]`` on the last step
says whether the episode reached its goal; without it, a positive final reward counts as success.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Env(Protocol):
    """A text environment with GEM's interface."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; the same seed gives the same episode."""
        ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the policy's text; return the next observation, reward, terminated, truncated, info."""
        ...


@dataclass
class StepResult:
    """One ``reset`` or ``step`` of one episode, as an env worker reports it to the driver.

    ``error`` is set (and the episode over) when the environment raised or passed its deadline.
    """

    episode: int
    observation: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated or self.error is not None


def is_success(reward: float, info: dict[str, Any]) -> bool:
    """The last step's ``info["success"]`` where the environment reports it, else a positive reward."""
    return bool(info["success"]) if "success" in info else reward > 0
