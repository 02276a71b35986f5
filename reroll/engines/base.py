"""The generation engine interface of actor_infer: every engine (hf, vllm, sglang) has these methods.

Also what the engines share: ``EngineAborted`` (raised by a ``generate`` that ``abort()`` stopped),
the ``engine_call`` decorator that guards ``generate``/``stream``/``score`` (clears the abort and
interrupt flags, refuses to run while asleep or without weights), ``in_prompt_order`` (a stream's
groups as ``generate`` returns them) and ``EngineStats`` (the counters behind ``metrics()``).

Two ways to stop a call from another thread: ``abort()`` cancels it (it raises ``EngineAborted``, its
completions are lost); ``interrupt()`` ends it early and keeps what it made: every response not yet
finished comes back with ``finish_reason == "abort"`` and the tokens generated so far, to be continued
later from prompt + response (partial rollouts) or dropped (over-sampling). The hf and vllm engines
stream (``stream``: each prompt's group as soon as all its samples finish); sglang does not. The hf
and vllm engines also stream tokens (``stream_tokens``: each response's new tokens every decoding
step, for ``reroll serve``'s ``stream: true``); what an engine can do is its spec's
(``reroll.config.engines.EngineSpec``: ``streams``, ``streams_tokens``, ``top_logprobs``,
``guided_decoding``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch

from reroll.data.types import Completion, SamplingParams, TokenDelta

F = TypeVar("F", bound=Callable[..., Any])


class EngineAborted(RuntimeError):
    """``generate`` was stopped by ``abort()``; none of that call's completions are returned."""


class Engine(Protocol):
    """Generates, takes new weights in place, sleeps and wakes, and reports its own metrics.

    Log-probs are those of the sampled tokens at the sampling temperature (as the trainer's
    ``token_logprobs``), so the two can be compared on every batch. Engines also offer
    ``score(input_ids, attention_mask, temperature)`` for tests (hf: any temperature, vllm: 1.0).
    """

    def generate(
        self, prompts: Sequence[str] | Sequence[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order; a prompt is text or token ids."""
        ...

    def stream(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams,
        budgets: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, list[Completion]]]:
        """``(prompt index, its params.n completions)`` as each prompt's samples have all finished, in
        the order they finish. ``budgets``: each prompt's own ``max_new_tokens`` (default: the params').
        After ``interrupt()`` the remaining groups are yielded as they stand (unfinished responses with
        ``finish_reason == "abort"``). Closing the iterator early drops the requests still running."""
        ...

    def stream_tokens(
        self, prompts: Sequence[str] | Sequence[list[int]], params: SamplingParams
    ) -> Iterator[TokenDelta]:
        """Each response's new tokens (with their log-probs) as the engine makes them, one ``TokenDelta``
        per response and decoding step; a response's last delta has its ``finish_reason``. The tokens
        of a response's deltas, joined, are those ``generate`` returns for the same seed and batch.
        Closing the iterator early stops the call. (Engines whose spec has ``streams_tokens``.)"""
        ...

    def interrupt(self) -> None:
        """End the call in flight (``generate`` or ``stream``) at its next decoding step, keeping what
        it generated (see the module docstring); a call that starts later runs in full."""
        ...

    def load_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of a weight update (whole layers; see ``reroll.runtime.weight_sync``)."""
        ...

    def finish_weight_update(self) -> None:
        """After the last bucket: drop what the old weights computed (prefix cache)."""
        ...

    def update_lora(self, adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Apply a LoRA adapter (peft's state-dict names, ``r``/``lora_alpha``) over the base weights."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free device memory (1: weights offloaded, 2: weights dropped; both: KV cache dropped)."""
        ...

    def wake_up(self) -> None:
        """Take the memory back; after ``sleep(2)`` the weights must be loaded again before generating."""
        ...

    def abort(self) -> None:
        """Stop an in-flight ``generate`` (from another thread): it raises ``EngineAborted``."""
        ...

    def metrics(self) -> dict[str, float]:
        """``engine/*`` counters since the last call (tokens/s, peak running requests, ...)."""
        ...


def engine_call(method: F) -> F:
    """Guards an engine's ``generate``/``score``: clears the abort flag (an ``abort()`` between calls
    cancels nothing), and raises if the engine is asleep (``self._asleep``: the sleep level, or None) or
    woke from ``sleep(2)`` without weights (``self._missing_weights``)."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._abort.clear()
        if hasattr(self, "_interrupt"):
            self._interrupt.clear()
        problem = None
        if self._asleep is not None:
            problem = f"the engine is asleep (level {self._asleep}); call wake_up() first"
        elif self._missing_weights:
            problem = "the engine woke from sleep(level=2) without weights; load them (load_weights, finish_weight_update) first"
        if problem is not None:
            raise RuntimeError(f"{type(self).__name__}.{method.__name__}: {problem}")
        return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


def in_prompt_order(groups: Iterable[tuple[int, list[Completion]]], n_prompts: int) -> list[list[Completion]]:
    """A stream's groups back in prompt order (what ``generate`` returns)."""
    out: list[list[Completion] | None] = [None] * n_prompts
    for i, group in groups:
        out[i] = group
    missing = [i for i, g in enumerate(out) if g is None]
    if missing:
        raise RuntimeError(f"the engine's stream ended without the groups of prompts {missing[:8]}")
    return out  # type: ignore[return-value]


class EngineStats:
    """What ``metrics()`` reports: throughput and peak load since the last ``take()``.

    ``engine/tokens_per_s``: generated tokens / seconds inside ``generate``; ``engine/num_running`` and
    ``engine/num_waiting``: the most requests (sequences) running at once / queued behind them;
    ``engine/kv_cache_usage``: the highest share of the KV cache in use. The last two only from
    engines with a scheduler and a fixed cache (vllm). Updated from the generating thread; read from any.
    """

    def __init__(self, *, scheduler: bool = False) -> None:
        """``scheduler``: the engine reports waiting requests and KV-cache usage (0 when idle)."""
        self._lock = threading.Lock()
        self._scheduler = scheduler
        self._reset()

    def _reset(self) -> None:
        self.peak_running = 0
        self.peak_waiting: int | None = 0 if self._scheduler else None
        self.peak_kv: float | None = 0.0 if self._scheduler else None

    def observe(
        self, *, running: int, waiting: int | None = None, kv_cache_usage: float | None = None
    ) -> None:
        with self._lock:
            self.peak_running = max(self.peak_running, running)
            if waiting is not None:
                self.peak_waiting = max(self.peak_waiting or 0, waiting)
            if kv_cache_usage is not None:
                self.peak_kv = max(self.peak_kv or 0.0, kv_cache_usage)

    def take(self, tokens: int, seconds: float) -> dict[str, float]:
        """The metrics for ``tokens`` generated in ``seconds``; the peaks start over."""
        with self._lock:
            out = {
                "engine/tokens_per_s": tokens / seconds if seconds else 0.0,
                "engine/num_running": float(self.peak_running),
            }
            if self.peak_waiting is not None:
                out["engine/num_waiting"] = float(self.peak_waiting)
            if self.peak_kv is not None:
                out["engine/kv_cache_usage"] = self.peak_kv
            self._reset()
        return out
