"""``reroll env-check``: run an environment with a random or scripted policy, no model, and check it.

Checked: ``reset`` returns ``(str, dict)``; ``step`` returns ``(str, float, bool, bool, dict)``; the
same seed gives the same first observation; every episode ends within ``max_turns``. Reported:
success rate, mean return, mean turns, and the first episode played out as text.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from reroll.envs.base import Env, is_success
from reroll.envs.registry import make_env
from reroll.errors import UserError

Policy = Literal["random", "scripted"]


@dataclass
class CheckReport:
    """What ``check_env`` measured."""

    name: str
    policy: str
    episodes: int
    successes: int = 0
    total_return: float = 0.0
    total_turns: int = 0
    unfinished: int = 0
    seconds: float = 0.0
    transcript: list[str] = field(default_factory=list)

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    def summary(self) -> str:
        n = max(self.episodes, 1)
        return (
            f"{self.name}: {self.episodes} episodes with the {self.policy} policy | success "
            f"{self.success_rate:.3f} | return {self.total_return / n:.3f} | turns {self.total_turns / n:.1f} | "
            f"unfinished {self.unfinished} | {self.seconds:.2f}s"
        )


def policy_action(env: Env, policy: Policy) -> str:
    """The random or scripted action for the environment's current state."""
    method = {"random": "sample_random_action", "scripted": "scripted_action"}[policy]
    fn = getattr(env, method, None)
    if fn is None:
        raise UserError(
            f"this environment has no {method}() for the {policy} policy; "
            + ("use --policy random" if policy == "scripted" else "add sample_random_action() to it")
        )
    return fn()


def check_env(
    name: str,
    config: dict[str, Any] | None = None,
    *,
    policy: Policy = "random",
    episodes: int = 20,
    seed: int = 0,
    max_turns: int = 100,
) -> CheckReport:
    """Play ``episodes`` episodes (seeds ``seed..``); a broken interface raises ``UserError``."""
    env = make_env(name, config)
    report = CheckReport(name, policy, episodes)
    start = time.perf_counter()
    for i in range(episodes):
        first = _reset(env, seed + i, name)
        if i == 0 and _reset(make_env(name, config), seed, name) != first:
            raise UserError(f"environment {name!r}: reset(seed={seed}) gave two different observations")
        _reset(env, seed + i, name)
        lines = [f"observation: {first}"]
        reward, info, done, turns = 0.0, {}, False, 0
        while not done and turns < max_turns:
            action = policy_action(env, policy)
            obs, reward, terminated, truncated, info = _step(env, action, name)
            report.total_return += reward
            done, turns = terminated or truncated, turns + 1
            lines += [f"action: {action}", f"observation: {obs} | reward {reward} | done {done}"]
        report.total_turns += turns
        report.unfinished += not done
        report.successes += done and is_success(reward, info)
        if i == 0:
            report.transcript = lines
    report.seconds = time.perf_counter() - start
    return report


def _reset(env: Env, seed: int, name: str) -> str:
    out = env.reset(seed=seed)
    if not (
        isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str) and isinstance(out[1], dict)
    ):
        raise UserError(
            f"environment {name!r}: reset() must return (observation: str, info: dict), got {out!r}"
        )
    return out[0]


def _step(env: Env, action: str, name: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    out = env.step(action)
    ok = isinstance(out, tuple) and len(out) == 5
    if ok:
        obs, reward, terminated, truncated, info = out
        ok = (
            isinstance(obs, str)
            and isinstance(reward, numbers.Real)
            and isinstance(terminated, bool)
            and isinstance(truncated, bool)
            and isinstance(info, dict)
        )
    if not ok:
        raise UserError(
            f"environment {name!r}: step() must return (observation: str, reward: float, terminated: bool, "
            f"truncated: bool, info: dict), got {out!r}"
        )
    return out[0], float(out[1]), out[2], out[3], out[4]
