"""Requests from many threads into shared engine calls: the chat server's and streamed episodes' batcher.

Each caller blocks in ``Batcher.submit`` on one prompt; one thread sends the waiting prompts to the
engine in one ``generate`` call per distinct sampling settings, so callers that arrive together share
the engine's batch. With ``expect`` (how many callers there are) and ``wait_s``, the thread waits up
to ``wait_s`` after the first prompt for the others, and sends at once when all ``expect`` wait: the
episodes of ``stream_episodes`` whose environments answer within the window share a call, while an
episode whose environment is slow stalls the others by at most ``wait_s``. ``leave`` says a caller is
done (a finished episode), so the rest do not wait for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from reroll.data.types import Completion, SamplingParams

Generate = Callable[[list[list[int]], SamplingParams], list[list[Completion]]]


class Batcher:
    """One thread that sends waiting requests to the engine. An engine failure fails those requests
    and is kept in ``failure``; ``sizes`` records the prompts of every ``generate`` call."""

    def __init__(self, generate: Generate, *, wait_s: float = 0.0, expect: int | None = None) -> None:
        self.generate, self.wait_s, self.expect = generate, wait_s, expect
        self.failure: BaseException | None = None
        self.sizes: list[int] = []
        self._pending: list[tuple[list[int], SamplingParams, Future]] = []
        self._closed = False
        self._cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions of ``prompt_ids`` (blocks until the engine call returns)."""
        done: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._pending.append((prompt_ids, params, done))
            self._cond.notify_all()
        return done.result()

    def leave(self) -> None:
        """One of the ``expect`` callers is done: a batch no longer waits for it."""
        with self._cond:
            if self.expect is not None:
                self.expect -= 1
            self._cond.notify_all()

    def _take(self) -> list[tuple[list[int], SamplingParams, Future]] | None:
        """The next batch: what waits once all expected callers wait or ``wait_s`` has passed."""
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            deadline = time.monotonic() + self.wait_s
            while not self._closed and self.expect is not None and len(self._pending) < self.expect:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            waiting, self._pending = self._pending, []
            return waiting or None

    def _loop(self) -> None:
        while (waiting := self._take()) is not None:
            by_params: dict[SamplingParams, list[tuple[list[int], Future]]] = {}
            for ids, params, done in waiting:
                by_params.setdefault(params, []).append((ids, done))
            for params, group in by_params.items():
                self.sizes.append(len(group))
                try:
                    out = self.generate([ids for ids, _ in group], params)
                except Exception as e:
                    self.failure = self.failure or e
                    for _, done in group:
                        done.set_exception(e)
                    continue
                for (_, done), completions in zip(group, out):
                    done.set_result(completions)

    def close(self) -> None:
        """Send what waits, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.thread.join(timeout=5)
