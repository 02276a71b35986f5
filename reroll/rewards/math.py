"""Math answers checked with Hugging Face's ``math-verify``: boxed answers, fractions, LaTeX, units.

The response's final answer is parsed and compared symbolically with the row's ``answer``
(``\\frac12`` equals ``0.5`` equals ``1/2``; ``10\\text{ cm}`` equals ``10``, as the verifier
strips units). With ``think=True`` only the text after the last ``</think>`` counts, so a number
written while reasoning is not taken as the answer; a ``<think>`` that is never closed scores 0.
Needs ``pip install 'reroll[math]'``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any

from reroll.errors import UserError
from reroll.rewards.base import RewardResult

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def final_answer_text(response: str, *, think: bool = True) -> str | None:
    """The part of ``response`` that holds the answer: after the last ``</think>`` when ``think``.

    ``None`` when a ``<think>`` block is opened and never closed (the model ran out of tokens while
    reasoning). Without any think tags the whole response counts.
    """
    if not think:
        return response
    if THINK_CLOSE in response:
        return response.rsplit(THINK_CLOSE, 1)[1]
    return None if THINK_OPEN in response else response


MISSING = "reward 'math_verify' needs the math-verify package: pip install 'reroll[math]' (or pip install math-verify)"


@functools.cache
def _verifier() -> Any:
    try:
        import math_verify
    except ImportError as e:
        raise UserError(MISSING) from e
    # Off the main thread its signal timeouts are off on purpose (the worker's deadline applies).
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda r: "Timeout is disabled" not in r.getMessage())
    return math_verify


def _gold_text(answer: Any) -> str:
    """A bare answer (``1/2``, ``\\frac{1}{2}``) wrapped in ``$...$`` so the LaTeX parser reads it."""
    text = str(answer).strip()
    return text if ("$" in text or "\\boxed" in text) else f"${text}$"


def math_verify(prompt: str, response: str, sample: Mapping[str, Any], *, think: bool = True) -> RewardResult:
    """1.0 if the response's final answer is mathematically equal to ``sample["answer"]``, else 0.0.

    details: ``correct`` 0/1, ``parsed`` 0/1 (an answer was found), ``unfinished_think`` 0/1.
    The verifier's own signal-based timeouts work only on the main thread; in a reward worker's
    thread pool the worker's per-sample deadline bounds the call instead.
    """
    mv = _verifier()
    text = final_answer_text(response, think=think)
    if text is None:
        return RewardResult(0.0, {"correct": 0, "parsed": 0, "unfinished_think": 1})
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(_gold_text(sample["answer"]), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the row's answer {sample['answer']!r} as math")
    pred = mv.parse(text, parsing_timeout=timeout)
    correct = int(bool(pred) and mv.verify(gold, pred, timeout_seconds=timeout))
    return RewardResult(
        float(correct), {"correct": correct, "parsed": int(bool(pred)), "unfinished_think": 0}
    )


def think_format(prompt: str, response: str, sample: Mapping[str, Any]) -> RewardResult:
    """1.0 if the response is ``<think>...</think>`` followed by a non-empty answer, else 0.0.

    A format reward to add, with a small weight, beside a correctness reward.
    """
    head, sep, tail = response.partition(THINK_CLOSE)
    ok = int(
        bool(sep) and head.lstrip().startswith(THINK_OPEN) and bool(tail.strip()) and THINK_CLOSE not in tail
    )
    return RewardResult(float(ok), {"format_ok": ok})
