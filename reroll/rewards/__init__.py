"""Per-sample reward functions, looked up by name (or ``package.module:function`` for your own)."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

from reroll.errors import UserError
from reroll.rewards.base import RewardFn, RewardResult


def _builtin() -> dict[str, RewardFn]:
    from reroll.rewards import rules

    return {"exact_match": rules.exact_match, "numeric_match": rules.numeric_match}


def reward_names() -> list[str]:
    return sorted(_builtin())


def resolve_reward(name: str) -> Callable[..., RewardResult]:
    """The function registered as ``name``, or imported from ``module:function``."""
    builtin = _builtin()
    if name in builtin:
        return builtin[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise UserError(f"reward.fn {name!r}: cannot import {attr!r} from {module!r} ({e})") from e
        if not callable(fn):
            raise UserError(f"reward.fn {name!r} is not callable")
        return fn
    close = difflib.get_close_matches(name, builtin, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UserError(
        f"reward.fn {name!r} is not a registered reward: {hint}choose one of {sorted(builtin)} "
        f"or give 'package.module:function'"
    )


__all__ = ["RewardFn", "RewardResult", "resolve_reward", "reward_names"]
