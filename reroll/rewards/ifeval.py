"""Instruction following: IFEval-style rule checks from the row's constraint list.

The row's ``constraints`` is a list of ``{"type": ..., "value": ...}``; the score is the fraction
met (``correct`` is 1 when all are). Types (``value`` in brackets):

========================  ====================================================================
min_words / max_words     word count at least / at most [int]
min_sentences / max_sentences  sentences (ended by . ! ?) at least / at most [int]
min_chars / max_chars     characters at least / at most [int]
include_keywords          every keyword appears, case-insensitive [list of str]
exclude_keywords          no keyword appears, case-insensitive [list of str]
keyword_frequency         ``{"keyword": str, "min": int}``: appears at least min times
json                      the whole response (or its ```json fence) parses as JSON [ignored]
lowercase / uppercase     no upper- / lower-case letters [ignored]
bullets                   exactly this many ``*``/``-`` bullet lines [int]
paragraphs                exactly this many paragraphs, split by blank lines or ``***`` [int]
starts_with / ends_with   the stripped response starts / ends with the phrase [str]
no_commas                 no ``,`` [ignored]
title                     a title in double angle brackets, ``<<like this>>`` [ignored]
placeholders              at least this many ``[placeholders]`` [int]
========================  ====================================================================

Only the text after ``</think>`` is checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from reroll.rewards.base import RewardResult
from reroll.rewards.math import final_answer_text

_WORD = re.compile(r"\b\w+\b")
_SENTENCE_END = re.compile(r"[.!?]+(?:\s|$)")
_BULLET = re.compile(r"^\s*[*-]\s+", re.MULTILINE)
_PARAGRAPH_SPLIT = re.compile(r"\n\s*\n|\n\s*\*\*\*\s*\n")


def _words(t: str) -> int:
    return len(_WORD.findall(t))


def _sentences(t: str) -> int:
    return len(_SENTENCE_END.findall(t.strip()))


def _is_json(t: str) -> bool:
    t = t.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*\n?(.*?)```", t, re.DOTALL)
    try:
        json.loads(fenced.group(1) if fenced else t)
    except (json.JSONDecodeError, ValueError):
        return False
    return True


def _has(t: str, kw: str) -> bool:
    return kw.lower() in t.lower()


def _frequency(t: str, v: Mapping[str, Any]) -> bool:
    return len(re.findall(rf"\b{re.escape(v['keyword'])}\b", t, re.IGNORECASE)) >= int(v["min"])


def _paragraphs(t: str) -> int:
    return len([p for p in _PARAGRAPH_SPLIT.split(t.strip()) if p.strip()])


CHECKS: dict[str, Callable[[str, Any], bool]] = {
    "min_words": lambda t, v: _words(t) >= int(v),
    "max_words": lambda t, v: _words(t) <= int(v),
    "min_sentences": lambda t, v: _sentences(t) >= int(v),
    "max_sentences": lambda t, v: _sentences(t) <= int(v),
    "min_chars": lambda t, v: len(t.strip()) >= int(v),
    "max_chars": lambda t, v: len(t.strip()) <= int(v),
    "include_keywords": lambda t, v: all(_has(t, k) for k in v),
    "exclude_keywords": lambda t, v: not any(_has(t, k) for k in v),
    "keyword_frequency": _frequency,
    "json": lambda t, v: _is_json(t),
    "lowercase": lambda t, v: t == t.lower() and any(c.isalpha() for c in t),
    "uppercase": lambda t, v: t == t.upper() and any(c.isalpha() for c in t),
    "bullets": lambda t, v: len(_BULLET.findall(t)) == int(v),
    "paragraphs": lambda t, v: _paragraphs(t) == int(v),
    "starts_with": lambda t, v: t.strip().lower().startswith(str(v).lower()),
    "ends_with": lambda t, v: t.strip().lower().endswith(str(v).lower()),
    "no_commas": lambda t, v: "," not in t,
    "title": lambda t, v: re.search(r"<<[^\n]+>>", t) is not None,
    "placeholders": lambda t, v: len(re.findall(r"\[[^\]\n]+\]", t)) >= int(v),
}


def check_constraint(text: str, constraint: Mapping[str, Any]) -> bool:
    """Whether ``text`` meets one ``{"type", "value"}`` constraint; an unknown type is an error."""
    kind = constraint.get("type")
    if kind not in CHECKS:
        raise ValueError(f"ifeval: unknown constraint type {kind!r}; known: {sorted(CHECKS)}")
    return bool(CHECKS[kind](text, constraint.get("value")))


def ifeval(prompt: str, response: str, sample: Mapping[str, Any]) -> RewardResult:
    """Fraction of ``sample["constraints"]`` the response meets. details: ``correct`` 0/1, ``met``."""
    constraints = sample["constraints"]
    if isinstance(constraints, str):
        constraints = json.loads(constraints)
    if not constraints:
        raise ValueError("ifeval: the row's constraints list is empty")
    text = final_answer_text(response) or ""
    met = sum(check_constraint(text, c) for c in constraints)
    fraction = met / len(constraints)
    return RewardResult(fraction, {"correct": int(met == len(constraints)), "met": fraction})
