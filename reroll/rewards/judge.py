"""LLM judges: ``llm_judge`` behind any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, a
hosted API), and ``engine_judge`` served by one of reroll's own engines as the ``judge`` role
(``reward.judge``, placed by ``roles.judge``; see ``reroll.roles.judge``).

Both format the same prompt template with ``prompt``, ``response``, ``max_score`` and the row's
fields, and parse the reply the same way: ``Score: N`` (else the last number in it), scaled by
``max_score`` to [0, 1]. A reply with no score, or a failed request, gives ``parse_error_score`` and
``details["judge_parse_error"] = 1`` (a request failure also ``judge_request_error = 1``), so the
count shows in ``reward/<domain>/judge_parse_error``. A dead judge role is not a parse error: it
fails the step with a ``RoleError`` naming the judge.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from reroll.rewards.base import RewardResult

DEFAULT_TEMPLATE = (
    "You are grading an answer.\n\nQuestion:\n{prompt}\n\nAnswer:\n{response}\n\n"
    "Rate the answer from 0 to {max_score}. Reply with a short reason, then a last line "
    "'Score: <number>'."
)
_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_score(text: str, *, max_score: float) -> float | None:
    """``Score: 7`` (the last one), else the last number, divided by ``max_score`` and clipped to [0, 1]."""
    found = _SCORE.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    return min(max(float(found[-1]) / max_score, 0.0), 1.0)


def llm_judge(
    prompt: str,
    response: str,
    sample: Mapping[str, Any],
    *,
    url: str,
    model: str = "default",
    template: str = DEFAULT_TEMPLATE,
    max_score: float = 10.0,
    parse_error_score: float = 0.0,
    api_key_env: str | None = None,
    timeout_s: float = 60.0,
    max_tokens: int = 256,
) -> RewardResult:
    """The judge's score of ``response`` in [0, 1]; see the module docstring.

    ``url`` is the server's base (``http://host:8000/v1``) or the full ``.../chat/completions``;
    ``api_key_env`` names an environment variable holding a bearer token.
    """
    content = judge_prompt(template, prompt, response, sample, max_score=max_score)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }
    endpoint = url if url.rstrip("/").endswith("/chat/completions") else url.rstrip("/") + "/chat/completions"
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    request = urllib.request.Request(endpoint, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            text = json.load(reply)["choices"][0]["message"]["content"] or ""
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError, TypeError):
        return RewardResult(parse_error_score, {"judge_parse_error": 1, "judge_request_error": 1})
    return judged(text, max_score=max_score, parse_error_score=parse_error_score)


def engine_judge(
    prompt: str,
    response: str,
    sample: Mapping[str, Any],
    *,
    judge: Callable[[str], str],
    template: str = DEFAULT_TEMPLATE,
    max_score: float = 10.0,
    parse_error_score: float = 0.0,
) -> RewardResult:
    """The ``judge`` role's score of ``response`` in [0, 1]; see the module docstring.

    ``judge`` (given by the reward worker, not the config) sends one prompt to the judge role and
    returns its greedy reply (``reroll.roles.judge.JudgeClient``).
    """
    text = judge(judge_prompt(template, prompt, response, sample, max_score=max_score))
    return judged(text, max_score=max_score, parse_error_score=parse_error_score)


def judge_prompt(
    template: str, prompt: str, response: str, sample: Mapping[str, Any], *, max_score: float
) -> str:
    """The template formatted with the row's fields, ``prompt``, ``response`` and ``max_score``."""
    return template.format(**{**sample, "prompt": prompt, "response": response, "max_score": max_score})


def judged(text: str, *, max_score: float, parse_error_score: float) -> RewardResult:
    """The result for a judge's reply ``text``: its parsed score, or ``parse_error_score``, counted."""
    score = parse_score(text, max_score=max_score)
    if score is None:
        return RewardResult(parse_error_score, {"judge_parse_error": 1, "judge_request_error": 0})
    return RewardResult(score, {"judge_parse_error": 0, "judge_request_error": 0})
