"""reward: workers that run per-sample reward functions, and their group.

Each worker scores its items on ``reward.threads`` threads, each call under its own deadline
(``reward.sample_timeout_s``). A call that raises or passes its deadline scores
``reward.error_score`` with ``details["reward_error"]`` / ``details["reward_timeout"]`` set, so
the step goes on and the count shows in ``reward/errors`` and ``reward/timeouts`` (and per domain
``reward/<domain>/reward_errors`` / ``reward_timeouts``), on the step line as ``rew_err`` /
``rew_timeout``. A raising call's message (its config key, function, error type and text, where the
user's code raised it) is kept in ``details["reward_error_message"]``; the group stops the run when
too many of a call's samples failed (``routing.check_failures``, ``reward.max_error_share``). Workers
log nothing per call: the group logs each kind of failure once, the first time it is seen, and writes
its traceback to ``errors_file`` (``ErrorLog``).

Rewards whose ``isolation`` is 'process' (by default every ``package.module:function`` reward) run
in a pool of ``reward.threads`` child processes (``reroll.rewards.isolation``): at the deadline the
child is killed and replaced. A 'thread' reward runs on the worker's thread; a timed-out thread
cannot be stopped (Python has no thread kill), so it is left to finish as a daemon and a new thread
takes its place. Registered rewards run on threads: they are bounded (code runs in its sandbox).
A ``RoleError`` raised by a reward (the judge role died) is not a reward failure: it fails the call.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reroll.config.reward import RewardConfig
from reroll.config.schema import RunConfig
from reroll.data.types import RewardItem
from reroll.errors import RoleError
from reroll.rewards.base import RewardResult
from reroll.rewards.isolation import ProcessPool, RewardTimeout
from reroll.rewards.routing import (
    RewardRouter,
    RewardTermError,
    check_failures,
    domain_terms,
    runs_isolated,
)
from reroll.roles.judge import JudgeClient, JudgeGroup
from reroll.runtime.actors import WorkerGroup
from reroll.runtime.console import shown

log = logging.getLogger(__name__)

# How long past its deadline a thread may take to report (an isolated call reports its own timeout
# once its process is killed) before the thread is given up as stuck and replaced.
_GRACE_S = 0.5


class RewardWorker:
    """Scores items with the configured rewards on a pool of threads, each call bounded in time."""

    def __init__(
        self,
        rank: int,
        cfg: RewardConfig,
        torch_threads: int | None = None,
        judge: JudgeClient | None = None,
    ) -> None:
        if torch_threads is not None:  # roles.reward.torch_threads (a reward model runs on CPU here)
            import torch

            torch.set_num_threads(torch_threads)
        self.rank, self.cfg = rank, cfg
        isolated = [(t.fn, t.args) for terms in domain_terms(cfg).values() for t in terms if runs_isolated(t)]
        self.pool = ProcessPool(cfg.threads, preload=isolated) if isolated else None
        self.router = RewardRouter(cfg, self.pool, judge)
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        for _ in range(cfg.threads):
            self._add_thread()

    def _add_thread(self) -> None:
        def serve() -> None:
            while True:
                self._jobs.get()()

        threading.Thread(target=serve, daemon=True, name=f"reward-{self.rank}").start()

    def close(self) -> None:
        """Stop the reward processes (the threads are daemons)."""
        if self.pool is not None:
            self.pool.close()

    def _failed(self, kind: str, error: BaseException | None = None) -> RewardResult:
        details: dict[str, Any] = {
            "reward_error": int(kind == "error"),
            "reward_timeout": int(kind == "timeout"),
            "correct": 0,
        }
        if error is not None:
            term = isinstance(error, RewardTermError)
            message = str(error) if term else f"{type(error).__name__}: {error}"
            details |= {
                "reward_error_message": message,
                _KIND: error.kind if term else type(error).__name__,  # type: ignore[union-attr]
                _TRACEBACK: error.traceback_text if term else "",  # type: ignore[union-attr]
            }
        return RewardResult(self.cfg.error_score, details)

    def score(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        results: list[RewardResult | None] = [None] * len(items)
        done: queue.Queue[tuple[int, RewardResult | BaseException]] = queue.Queue()
        deadlines: dict[int, float] = {}  # set when a thread picks the item up
        limit = self.cfg.sample_timeout_s

        def job(i: int, it: RewardItem) -> Callable[[], None]:
            def run() -> None:
                deadlines[i] = deadline = time.monotonic() + limit
                try:
                    done.put(
                        (i, self.router.score(it.prompt, it.response, it.row, it.domain, deadline=deadline))
                    )
                except BaseException as e:  # reported as a counted error or timeout, never raised
                    done.put((i, e))
                if self.pool is not None:
                    self.pool.refill()  # replace a killed process before this thread takes more work

            return run

        for i, it in enumerate(items):
            self._jobs.put(job(i, it))
        remaining = set(range(len(items)))
        while remaining:
            started = [deadlines[i] + _GRACE_S for i in remaining if i in deadlines]
            wait = max(0.0, min(started) - time.monotonic()) if started else 0.05
            try:
                i, out = done.get(timeout=wait)
            except queue.Empty:
                self._expire(remaining, deadlines, results)
                continue
            if i in remaining:  # not already scored as a timeout
                remaining.discard(i)
                if isinstance(out, RoleError):  # another role (the judge) failed: so does this call
                    raise OtherRoleFailed(out.role, out.rank, out.phase, out.cause, out.died) from out
                if isinstance(out, RewardTimeout):
                    out = self._failed("timeout")
                elif isinstance(out, BaseException):
                    out = self._failed("error", out)
                results[i] = out
        return results  # type: ignore[return-value]

    def _expire(self, remaining: set[int], deadlines: dict[int, float], results: list) -> None:
        """Score the items past their deadline as timeouts; a new thread replaces each stuck one."""
        now = time.monotonic()
        for i in [i for i in remaining if deadlines.get(i, now + 1) + _GRACE_S <= now]:
            results[i] = self._failed("timeout")
            remaining.discard(i)
            self._add_thread()


@dataclass
class PendingScores:
    """A ``RewardGroup.submit`` in flight: per-rank references, and the rounds of ``reward.threads``
    calls its largest part takes (what its wait is bounded by)."""

    refs: list[Any]
    rounds: int


_KIND = "reward_error_kind"  # details a worker sets on a failed call, which the group takes out
_TRACEBACK = "reward_error_traceback"


@dataclass
class ErrorLog:
    """Each kind of reward failure (a reward's error type where it was raised, or a timeout), said once:
    a log line the first time it is seen, with how many of that call's samples failed and where the
    traceback is, and the traceback appended to ``path``. Until ``path`` is set (a run's directory is
    written from its first metrics on), what is seen waits in ``pending``."""

    timeout_s: float = 30.0  # reward.sample_timeout_s, for the line that says calls timed out
    path: Path | None = None
    seen: set[str] = field(default_factory=set)
    pending: list[tuple[str, str, str, int, int]] = field(default_factory=list)

    def note(self, results: Sequence[RewardResult], phase: str) -> list[RewardResult]:
        """``results`` without the traceback details; the kinds not seen before are kept to report."""
        out, first = [], {}
        timeout = f"a call passed reward.sample_timeout_s={self.timeout_s:g}s"
        for r in results:
            kind = r.details.get(_KIND) or (timeout if r.details.get("reward_timeout") else None)
            if kind is None:
                out.append(r)
                continue
            message = str(r.details.get("reward_error_message", kind))
            first.setdefault(str(kind), (message, str(r.details.get(_TRACEBACK, ""))))
            keep = {k: v for k, v in r.details.items() if k not in (_KIND, _TRACEBACK)}
            out.append(replace(r, details=keep))
        failed = sum(1 for r in results if r.details.get("reward_error") or r.details.get("reward_timeout"))
        for kind, (message, text) in first.items():
            if kind not in self.seen:
                self.seen.add(kind)
                self.pending.append((phase, message, text, failed, len(results)))
        self.flush()
        return out

    def write_to(self, path: Path) -> None:
        """Append tracebacks to ``path`` from now on (and what waited)."""
        self.path = path
        self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        for phase, message, text, failed, total in self.pending:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(f"== during {phase}: {failed} of {total} samples failed\n{message}\n{text}\n")
            where = f"; the traceback: {shown(self.path)}" if text else ""
            log.warning(
                "reward: %d of %d samples failed during %s: %s%s (said once; the step line counts failures "
                "as rew_err / rew_timeout, eval_err / eval_timeout)",
                failed, total, phase, message, where,
            )  # fmt: skip
        self.pending.clear()


class RewardGroup(WorkerGroup):
    """All reward ranks; items are dealt in contiguous blocks; each rank's call is bounded (see timeout_s).
    Failures are said once per kind (``errors``)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.reward_cfg = cfg.reward
        self.errors = ErrorLog(cfg.reward.sample_timeout_s)
        self.judge = JudgeGroup(cfg) if cfg.reward.judge is not None else None
        make_args = lambda rank: (rank, cfg.reward, cfg.roles.reward.torch_threads, self._client())  # noqa: E731
        super().__init__("reward", RewardWorker, make_args, cfg, timeout_s=cfg.reward.timeout_s)

    def _client(self) -> JudgeClient | None:
        return self.judge.client() if self.judge is not None else None

    def restart(self, *, judge: bool = False) -> None:
        """Fresh reward workers; ``judge``: the judge's ranks first (the workers call the new ones)."""
        if judge and self.judge is not None:
            self.judge.restart()
        super().restart()

    def score(self, items: Sequence[RewardItem], phase: str = "reward") -> list[RewardResult]:
        """Results for ``items``, in order; ``RewardFailure`` (the run stops) when too many calls failed."""
        return self.collect([self.submit(items)], phase)

    def submit(self, items: Sequence[RewardItem]) -> PendingScores:
        """Start scoring ``items`` on every rank and return at once (for ``collect``)."""
        parts = self._deal(items)
        rounds = math.ceil(max(map(len, parts), default=0) / self.reward_cfg.threads)
        return PendingScores([h.score.remote(part) for h, part in zip(self.handles, parts)], rounds)

    def collect(self, pending: Sequence[PendingScores], phase: str = "reward") -> list[RewardResult]:
        """The results of ``submit`` calls, in order, checked together as ``score`` checks them."""
        rc = self.reward_cfg
        results = []
        for p in pending:
            self.timeout_s = rc.timeout_s + p.rounds * rc.sample_timeout_s
            try:
                results += [r for part in self._wait(p.refs, phase) for r in part]
            except RoleError as e:
                raise _other_role_error(e) or e from e
        check_failures(results, rc, phase)
        return self.errors.note(results, phase)

    def shutdown(self) -> None:
        """Stop each worker's reward processes, then the workers."""
        try:
            self._wait([h.close.remote() for h in self.handles], "shutdown")
        except RoleError as e:  # a dead worker's children end with it (they watch their parent)
            log.log(logging.DEBUG if e.died else logging.WARNING, "%s", e)
        super().shutdown()
        if self.judge is not None:
            self.judge.shutdown()


class OtherRoleFailed(Exception):
    """A ``RoleError`` of another role (the judge) raised in a reward worker, in a form that crosses
    Ray (``RoleError`` itself does not unpickle); ``RewardGroup`` raises it as that ``RoleError``."""

    def __init__(self, role: str, rank: int | None, phase: str, cause: str, died: bool = False) -> None:
        super().__init__(role, rank, phase, cause, died)

    def role_error(self) -> RoleError:
        *fields, died = self.args
        return RoleError(*fields, died=died)

    def __str__(self) -> str:
        return str(self.role_error())


def _other_role_error(e: BaseException | None) -> RoleError | None:
    """The other role's ``RoleError`` behind a reward worker's failure, if that is what it was."""
    for _ in range(8):
        if e is None:
            return None
        if type(e) is OtherRoleFailed:  # not Ray's wrapper, which subclasses it
            return e.role_error()
        inner = getattr(e, "cause", None)  # a RayTaskError's cause; a RoleError's is a string
        e = inner if isinstance(inner, BaseException) else e.__cause__
    return None
