"""The shape of a reward function: a plain per-sample callable."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RewardResult:
    """What a reward function returns for one response.

    score: the scalar reward. details: anything worth logging (extracted answer, tests passed, ...);
    numeric details are averaged into ``reward/<name>/<key>`` metrics.
    """

    score: float
    details: Mapping[str, Any] = field(default_factory=dict)


class RewardFn(Protocol):
    """``fn(prompt, response, sample) -> RewardResult``; ``sample`` is the dataset row (answer, tests, ...)."""

    def __call__(self, prompt: str, response: str, sample: Mapping[str, Any]) -> RewardResult: ...
