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
        rc = cfg.roles.reward
        super().__init__(
            "reward",
            RewardWorker,
            lambda rank: (rank, cfg.reward.fn),
            world_size=rc.world_size,
            backend=cfg.runtime.backend,
            num_cpus=rc.num_cpus_per_worker,
            num_gpus=rc.num_gpus_per_worker,
            timeout_s=cfg.reward.timeout_s,
        )

    def score(self, items: Sequence[tuple[str, str, dict]], phase: str = "reward") -> list[RewardResult]:
        n = self.world_size
        bounds = [round(i * len(items) / n) for i in range(n + 1)]
        refs = [h.score.remote(list(items[a:b])) for h, a, b in zip(self.handles, bounds, bounds[1:])]
        return [r for part in self._wait(refs, phase) for r in part]
