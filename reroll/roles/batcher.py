"""Requests from many threads into shared engine calls: the chat server's and streamed episodes' batcher.

Each caller blocks in ``Batcher.submit`` on one prompt; one thread sends the waiting prompts to the
engine in one ``generate`` call per distinct sampling settings, so callers that arrive together share
the engine's batch. With ``expect`` (how many callers there are) and ``wait_s``, the thread waits up
to ``wait_s`` after the first prompt for the others, and sends at once when all ``expect`` wait: the
episodes of ``stream_episodes`` whose environments answer within the window share a call, while an
episode whose environment is slow stalls the others by at most ``wait_s``. ``leave`` says a caller is
done (a finished episode), so the rest do not wait for it.

``stream`` is ``submit`` token by token (``reroll serve``'s ``stream: true``): the streamed requests
that wait together go to the engine in one ``stream_tokens`` call, whose deltas are handed to each
caller as the engine makes them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace

from reroll.data.types import Completion, SamplingParams, TokenDelta

Generate = Callable[[list[list[int]], SamplingParams], list[list[Completion]]]
StreamTokens = Callable[[list[list[int]], SamplingParams], Iterator[TokenDelta]]


class _Sink:
    """Where a streamed request's deltas go: a queue its caller empties, ended by ``None`` (or an error)."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts, self.queue = prompts, queue.Queue()


class Batcher:
    """One thread that sends waiting requests to the engine. An engine failure fails those requests
    and is kept in ``failure``; ``sizes`` records the prompts of every ``generate`` call."""

    def __init__(
        self,
        generate: Generate,
        *,
        stream_tokens: StreamTokens | None = None,
        wait_s: float = 0.0,
        expect: int | None = None,
    ) -> None:
        self.generate, self.stream_tokens = generate, stream_tokens
        self.wait_s, self.expect = wait_s, expect
        self.failure: BaseException | None = None
        self.sizes: list[int] = []
        self._pending: list[tuple[list[int], SamplingParams, Future | _Sink]] = []
        self._closed = False
        self._cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions of ``prompt_ids`` (blocks until the engine call returns)."""
        return self.submit_many([prompt_ids], params)[0]

    def submit_many(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions of each prompt, in prompt order (one engine call where they wait together)."""
        waiting: list[Future] = [Future() for _ in prompts]
        self._add([(ids, params, done) for ids, done in zip(prompts, waiting)])
        return [done.result() for done in waiting]

    def stream(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[TokenDelta]:
        """The deltas of ``params.n`` responses to each prompt as the engine makes them (``prompt`` is
        the index in ``prompts``); needs ``stream_tokens``. An engine failure is raised here."""
        if self.stream_tokens is None:
            raise RuntimeError("this batcher was made without stream_tokens")
        sink = _Sink(prompts)
        self._add([(prompts[0], params, sink)])  # one entry: the sink holds all its prompts
        while (item := sink.queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _add(self, entries: list[tuple[list[int], SamplingParams, Future | _Sink]]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._pending.extend(entries)
            self._cond.notify_all()

    def leave(self) -> None:
        """One of the ``expect`` callers is done: a batch no longer waits for it."""
        with self._cond:
            if self.expect is not None:
                self.expect -= 1
            self._cond.notify_all()

    def _take(self) -> list[tuple[list[int], SamplingParams, Future | _Sink]] | None:
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
            calls: dict[tuple[SamplingParams, bool], list[tuple[list[int], Future | _Sink]]] = {}
            for ids, params, done in waiting:
                calls.setdefault((params, isinstance(done, _Sink)), []).append((ids, done))
            for (params, streamed), group in calls.items():
                if streamed:
                    self._stream([sink for _, sink in group], params)  # type: ignore[misc]
                    continue
                self.sizes.append(len(group))
                try:
                    out = self.generate([ids for ids, _ in group], params)
                except Exception as e:
                    self.failure = self.failure or e
                    for _, done in group:
                        done.set_exception(e)  # type: ignore[union-attr]
                    continue
                for (_, done), completions in zip(group, out):
                    done.set_result(completions)  # type: ignore[union-attr]

    def _stream(self, sinks: list[_Sink], params: SamplingParams) -> None:
        """One ``stream_tokens`` call for the streamed requests that waited together: each delta goes
        to its request's sink, with the prompt index that request gave."""
        assert self.stream_tokens is not None
        owner = [(sink, i) for sink in sinks for i in range(len(sink.prompts))]
        self.sizes.append(len(owner))
        try:
            for delta in self.stream_tokens([p for sink in sinks for p in sink.prompts], params):
                sink, i = owner[delta.prompt]
                sink.queue.put(replace(delta, prompt=i))
        except Exception as e:
            self.failure = self.failure or e
            for sink in sinks:
                sink.queue.put(e)
        for sink in sinks:
            sink.queue.put(None)

    def close(self) -> None:
        """Send what waits, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.thread.join(timeout=5)
