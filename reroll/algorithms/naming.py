"""How an algorithm name is checked and an unknown one reported: the valid names listed, a close match,
and other frameworks' names for ours. A leaf module: the algorithm modules raise through it, and the
registry (``reroll.algorithms.registry``) gathers their tables."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

# Names other frameworks use, so that a user arriving from verl / OpenRLHF / TRL gets pointed at ours.
ALIASES = {
    "reinforce_plus_plus": "reinforce_pp",
    "reinforce": "reinforce_pp",
    "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
    "reinforce_baseline": "reinforce_pp_baseline",
    "group_norm": "grpo",
    "dr_grpo": "grpo (with std_scale 'none')",
    "vanilla": "ppo_clip",
    "ppo": "ppo_clip",
    "reinforce_loss": "pg",
    "low_var_kl": "k3",
    "mse": "k2",
    "kl": "k1",
}


class UnknownAlgorithmError(KeyError):
    """An algorithm name that no table holds; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def unknown_name_message(kind: str, name: str, valid: list[str]) -> str:
    """'unknown adv_estimator 'x': valid names are a, b, c' plus a close match or another framework's alias."""
    message = f"unknown {kind} {name!r}: valid names are {', '.join(repr(v) for v in valid)}"
    if name in ALIASES:
        return f"{message} (other frameworks' {name!r} is {ALIASES[name]!r} here)"
    close = difflib.get_close_matches(name, valid, n=1)
    return f"{message} (did you mean {close[0]!r}?)" if close else message


def pick(kind: str, table: Mapping[str, Callable[..., Any]], name: str) -> Callable[..., Any]:
    """``table[name]``; ``UnknownAlgorithmError`` lists the valid names of ``kind``."""
    if name not in table:
        raise UnknownAlgorithmError(unknown_name_message(kind, name, list(table)))
    return table[name]
