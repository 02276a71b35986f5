"""Rule-based rewards: compare the response with the row's ``answer``."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from reroll.rewards.base import RewardResult

# An optionally signed integer or decimal, with optional thousands separators: "-12", "3.5", "1,024".
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def exact_match(prompt: str, response: str, sample: Mapping[str, Any]) -> RewardResult:
    """1.0 if ``response.strip() == str(sample["answer"]).strip()``, else 0.0. details: ``{"correct": 0/1}``."""
    correct = int(response.strip() == str(sample["answer"]).strip())
    return RewardResult(score=float(correct), details={"correct": correct})


def numeric_match(
    prompt: str, response: str, sample: Mapping[str, Any], *, rel_tol: float = 1e-6
) -> RewardResult:
    """1.0 if the last number in ``response`` equals ``sample["answer"]`` as a number, else 0.0.

    "The answer is 46." scores 1 for answer "46"; so do "46.0" and "1,046" for "1046". Values are
    compared with ``math.isclose(rel_tol=rel_tol, abs_tol=rel_tol)``. details: ``{"correct": 0/1,
    "parsed": 0/1}`` (``parsed`` is 0 when the response holds no number).
    """
    predicted = parse_last_number(response)
    expected = parse_last_number(str(sample["answer"]))
    if expected is None:
        raise ValueError(
            f"numeric_match: sample answer {sample['answer']!r} holds no number; use exact_match"
        )
    correct = int(
        predicted is not None and math.isclose(predicted, expected, rel_tol=rel_tol, abs_tol=rel_tol)
    )
    return RewardResult(
        score=float(correct), details={"correct": correct, "parsed": int(predicted is not None)}
    )


def parse_last_number(text: str) -> float | None:
    """The last number in ``text`` as a float (``"x = -3.5."`` -> -3.5), or None if there is none."""
    matches = _NUMBER.findall(text)
    return float(matches[-1].replace(",", "")) if matches else None
