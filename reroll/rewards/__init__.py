"""Per-sample reward functions, looked up by name (or ``package.module:function`` for your own).

A reward is ``fn(prompt, response, sample, **args) -> RewardResult``, or takes the row's fields as
keywords, ``fn(response, answer, **kwargs)`` (``reroll.rewards.calling``); ``args`` come from the
config (``reward.args`` or a domain reward's ``args``). ``resolve_reward`` returns either form as one
callable ``(prompt, response, row)``. Modules load on first use, so optional dependencies
(math-verify) are needed only by the rewards that use them.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from reroll.config.reward import RENAMED_FNS
from reroll.errors import UserError
from reroll.rewards.base import RewardFn, RewardResult
from reroll.rewards.calling import KeywordReward, call_form

# name -> ("module:function", row fields it reads)
REGISTRY: dict[str, tuple[str, tuple[str, ...]]] = {
    "exact_match": ("reroll.rewards.rules:exact_match", ("answer",)),
    "numeric_match": ("reroll.rewards.rules:numeric_match", ("answer",)),
    "math_verify": ("reroll.rewards.math:math_verify", ("answer",)),
    "think_format": ("reroll.rewards.math:think_format", ()),
    "code_tests": ("reroll.rewards.code:code_tests", ("tests",)),
    "ifeval": ("reroll.rewards.ifeval:ifeval", ("constraints",)),
    "llm_judge": ("reroll.rewards.judge:llm_judge", ()),
    "engine_judge": ("reroll.rewards.judge:engine_judge", ()),
    "classifier_score": ("reroll.rewards.classifier:classifier_score", ()),
}
RENAMED = RENAMED_FNS  # renamed rewards: the old name still works


def reward_names() -> list[str]:
    return sorted(REGISTRY)


def required_fields(name: str) -> tuple[str, ...]:
    """The row fields a registered reward reads (none known for a user function)."""
    name = RENAMED.get(name, name)
    return REGISTRY[name][1] if name in REGISTRY else ()


def _import(path: str, name: str) -> Callable[..., RewardResult]:
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"reward.fn {name!r}: cannot import {attr!r} from {module!r} ({e})") from e
    except Exception as e:  # the module itself fails on import (a syntax error, a failing top level)
        raise UserError(
            f"reward.fn {name!r}: importing {module!r} raised {type(e).__name__}: {e}: fix the module"
        ) from e
    if not callable(fn):
        raise UserError(f"reward.fn {name!r} is not callable")
    return fn


def resolve_reward(name: str, args: Mapping[str, Any] | None = None) -> Callable[..., RewardResult]:
    """The function registered as ``name``, or imported from ``module:function``, with ``args`` bound,
    callable as ``(prompt, response, row)`` whichever form it takes (``reroll.rewards.calling``)."""
    return called(load_reward(name), args)


def called(fn: Callable[..., Any], args: Mapping[str, Any] | None = None) -> Callable[..., RewardResult]:
    """``fn`` with ``args``, callable as ``(prompt, response, row)`` in either call form."""
    if call_form(fn) == "keywords":
        return KeywordReward(fn, args)
    return functools.partial(fn, **args) if args else fn


def load_reward(name: str) -> Callable[..., Any]:
    """The function registered as ``name``, or imported from ``module:function``, as it is written."""
    name = RENAMED.get(name, name)
    if name in REGISTRY:
        fn = _import(REGISTRY[name][0], name)
    elif ":" in name:
        fn = _import(name, name)
    else:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(
            f"reward.fn {name!r} is not a registered reward: {hint}choose one of {reward_names()} "
            f"or give 'package.module:function'"
        )
    return fn


__all__ = [
    "REGISTRY",
    "RewardFn",
    "RewardResult",
    "called",
    "load_reward",
    "required_fields",
    "resolve_reward",
    "reward_names",
]
