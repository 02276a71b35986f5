"""The shape of a reward function: a plain per-sample callable."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RewardResult:
    """What a reward function returns for one response.

    score: the scalar reward. details: anything worth logging (extracted answer, tests passed, ...);
    ``correct`` (0/1) decides accuracy (else ``score >= 1``); with ``reward.domains``, numeric details
    are averaged into ``reward/<domain>/<key>`` metrics. A reward may also return a plain number
    (``as_result``)."""

    score: float
    details: Mapping[str, Any] = field(default_factory=dict)


class RewardFn(Protocol):
    """``fn(prompt, response, sample) -> RewardResult``; ``sample`` is the dataset row (answer, tests, ...)."""

    def __call__(self, prompt: str, response: str, sample: Mapping[str, Any]) -> RewardResult: ...


def as_result(value: Any) -> RewardResult:
    """What a reward function returned, as a ``RewardResult``: one as it is, a plain number (``1.0``,
    ``True``, a numpy scalar) as its score with no details; anything else is a ``TypeError`` saying
    what to return."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, numbers.Real):
        return RewardResult(float(value))
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise TypeError(
        f"returned {type(value).__name__} {shown}: return a number or RewardResult(score, details) "
        f"(from reroll.rewards import RewardResult)"
    )
