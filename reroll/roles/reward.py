"""reward: workers that run per-sample reward functions, and their group.

Each worker scores its items on ``reward.threads`` threads, each call under its own deadline
(``reward.sample_timeout_s``). A call that raises or passes its deadline scores
``reward.error_score`` with ``details["reward_error"]`` / ``details["reward_timeout"]`` set, so
the step goes on and the count shows in ``reward/errors`` and ``reward/timeouts``. A timed-out
call's thread cannot be stopped (Python has no thread kill): it is left to finish in the
background, as a daemon, and a new thread takes its place in the pool. Rewards that can hang (code) run out of process with their own limits.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from reroll.config.reward import RewardConfig
from reroll.config.schema import RunConfig
from reroll.rewards.base import RewardResult
from reroll.rewards.routing import DEFAULT_DOMAIN, RewardRouter
from reroll.runtime.actors import WorkerGroup

log = logging.getLogger(__name__)


class RewardItem(NamedTuple):
    """What a reward worker scores: the prompt, the response, the dataset row and the row's tag."""

    prompt: str
    response: str
    row: dict
    tag: str = DEFAULT_DOMAIN


class RewardWorker:
    """Scores items with the configured rewards on a pool of threads, each call bounded in time."""

    def __init__(self, rank: int, cfg: RewardConfig, torch_threads: int | None = None) -> None:
        if torch_threads is not None:  # roles.reward.torch_threads (a reward model runs on CPU here)
            import torch

            torch.set_num_threads(torch_threads)
        self.rank, self.cfg = rank, cfg
        self.router = RewardRouter(cfg)
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        for _ in range(cfg.threads):
            self._add_thread()

    def _add_thread(self) -> None:
        def serve() -> None:
            while True:
                self._jobs.get()()

        threading.Thread(target=serve, daemon=True, name=f"reward-{self.rank}").start()

    def _failed(self, kind: str) -> RewardResult:
        return RewardResult(
            self.cfg.error_score,
            {"reward_error": int(kind == "error"), "reward_timeout": int(kind == "timeout"), "correct": 0},
        )

    def score(self, items: Sequence[tuple]) -> list[RewardResult]:
        items = [RewardItem(*it) for it in items]
        results: list[RewardResult | None] = [None] * len(items)
        done: queue.Queue[tuple[int, RewardResult | BaseException]] = queue.Queue()
        deadlines: dict[int, float] = {}  # set when a thread picks the item up
        limit = self.cfg.sample_timeout_s

        def job(i: int, it: RewardItem) -> Callable[[], None]:
            def run() -> None:
                deadlines[i] = time.monotonic() + limit
                try:
                    done.put((i, self.router.score(it.prompt, it.response, it.row, it.tag)))
                except BaseException as e:  # reported as a counted error, never raised
                    done.put((i, e))

            return run

        for i, it in enumerate(items):
            self._jobs.put(job(i, it))
        remaining = set(range(len(items)))
        while remaining:
            started = [deadlines[i] for i in remaining if i in deadlines]
            wait = max(0.0, min(started) - time.monotonic()) if started else 0.05
            try:
                i, out = done.get(timeout=wait)
            except queue.Empty:
                self._expire(remaining, deadlines, results)
                continue
            if i in remaining:  # not already scored as a timeout
                remaining.discard(i)
                if isinstance(out, BaseException):
                    log.warning(
                        "reward rank %d: item %d raised %s: %s", self.rank, i, type(out).__name__, out
                    )
                    out = self._failed("error")
                results[i] = out
        return results  # type: ignore[return-value]

    def _expire(self, remaining: set[int], deadlines: dict[int, float], results: list) -> None:
        """Score the items past their deadline as timeouts; a new thread replaces each stuck one."""
        now = time.monotonic()
        for i in [i for i in remaining if deadlines.get(i, now + 1) <= now]:
            log.warning(
                "reward rank %d: item %d passed sample_timeout_s=%gs", self.rank, i, self.cfg.sample_timeout_s
            )
            results[i] = self._failed("timeout")
            remaining.discard(i)
            self._add_thread()


class RewardGroup(WorkerGroup):
    """All reward ranks; items are dealt in contiguous blocks; each rank's call is bounded (see timeout_s)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.reward_cfg = cfg.reward
        make_args = lambda rank: (rank, cfg.reward, cfg.roles.reward.torch_threads)  # noqa: E731
        super().__init__("reward", RewardWorker, make_args, cfg, timeout_s=cfg.reward.timeout_s)

    def score(self, items: Sequence[tuple], phase: str = "reward") -> list[RewardResult]:
        """Results for ``(prompt, response, row[, tag])`` items, in order."""
        parts = self._deal(items)
        rc = self.reward_cfg
        rounds = math.ceil(max(map(len, parts), default=0) / rc.threads)
        self.timeout_s = rc.timeout_s + rounds * rc.sample_timeout_s
        refs = [h.score.remote(part) for h, part in zip(self.handles, parts)]
        return [r for part in self._wait(refs, phase) for r in part]
