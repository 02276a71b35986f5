"""Name -> function, for every algorithm the config can select; an unknown name lists the valid ones.

Kinds: ``adv_estimator``, ``policy_loss``, ``kl_estimator``, ``loss_agg_mode``, ``reward_norm``.
The tables live beside their functions (``ADV_ESTIMATORS`` in ``advantages.py``, ...) and
are gathered here on first use, so that those modules may raise ``UnknownAlgorithmError``
without an import cycle.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from functools import cache
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


@cache
def tables() -> dict[str, dict[str, Callable[..., Any]]]:
    """Every kind's name -> function table."""
    from reroll.algorithms.advantages import ADV_ESTIMATORS
    from reroll.algorithms.aggregation import LOSS_AGG_MODES
    from reroll.algorithms.kl import KL_ESTIMATORS
    from reroll.algorithms.losses import POLICY_LOSSES
    from reroll.algorithms.shaping import REWARD_NORMS

    return {
        "adv_estimator": ADV_ESTIMATORS,
        "policy_loss": POLICY_LOSSES,
        "kl_estimator": KL_ESTIMATORS,
        "loss_agg_mode": LOSS_AGG_MODES,
        "reward_norm": REWARD_NORMS,
    }


def unknown_name_message(kind: str, name: str, valid: list[str]) -> str:
    """'unknown adv_estimator 'x': valid names are a, b, c' plus a close match or another framework's alias."""
    message = f"unknown {kind} {name!r}: valid names are {', '.join(repr(v) for v in valid)}"
    if name in ALIASES:
        return f"{message} (other frameworks' {name!r} is {ALIASES[name]!r} here)"
    close = difflib.get_close_matches(name, valid, n=1)
    return f"{message} (did you mean {close[0]!r}?)" if close else message


def names(kind: str) -> list[str]:
    """The valid names of one kind."""
    return list(lookup_table(kind))


def lookup_table(kind: str) -> dict[str, Callable[..., Any]]:
    """The name -> function table of one kind."""
    all_tables = tables()
    if kind not in all_tables:
        raise UnknownAlgorithmError(unknown_name_message("algorithm kind", kind, list(all_tables)))
    return all_tables[kind]


def lookup(kind: str, name: str) -> Callable[..., Any]:
    """The function registered as ``name`` under ``kind``; ``UnknownAlgorithmError`` lists the valid names."""
    table = lookup_table(kind)
    if name not in table:
        raise UnknownAlgorithmError(unknown_name_message(kind, name, list(table)))
    return table[name]
