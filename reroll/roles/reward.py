"""reward: workers that run per-sample reward functions, and their group."""

from __future__ import annotations

from collections.abc import Sequence

from reroll.config.schema import RunConfig
from reroll.rewards import resolve_reward
from reroll.rewards.base import RewardResult
from reroll.runtime.actors import WorkerGroup


class RewardWorker:
    """Scores (prompt, response, row) triples with the configured reward function."""

    def __init__(self, rank: int, fn_name: str) -> None:
        self.rank = rank
        self.fn = resolve_reward(fn_name)

    def score(self, items: list[tuple[str, str, dict]]) -> list[RewardResult]:
        return [self.fn(prompt, response, row) for prompt, response, row in items]


class RewardGroup(WorkerGroup):
    """All reward ranks; items are dealt in contiguous blocks; each call is bounded by reward.timeout_s."""

    def __init__(self, cfg: RunConfig) -> None:
        make_args = lambda rank: (rank, cfg.reward.fn)  # noqa: E731
        super().__init__("reward", RewardWorker, make_args, cfg, timeout_s=cfg.reward.timeout_s)

    def score(self, items: Sequence[tuple[str, str, dict]], phase: str = "reward") -> list[RewardResult]:
        refs = [h.score.remote(part) for h, part in zip(self.handles, self._deal(items))]
        return [r for part in self._wait(refs, phase) for r in part]
