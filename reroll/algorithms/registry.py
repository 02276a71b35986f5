"""Name -> function, for every algorithm the config can select; an unknown name lists the valid ones.

Kinds: ``adv_estimator``, ``policy_loss``, ``kl_estimator``, ``loss_agg_mode``, ``reward_norm``.
The tables live beside their functions (``ADV_ESTIMATORS`` in ``advantages.py``, ...) and are
gathered here; those modules report an unknown name through ``reroll.algorithms.naming``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reroll.algorithms.advantages import ADV_ESTIMATORS
from reroll.algorithms.aggregation import LOSS_AGG_MODES
from reroll.algorithms.kl import KL_ESTIMATORS
from reroll.algorithms.losses import POLICY_LOSSES
from reroll.algorithms.naming import ALIASES, UnknownAlgorithmError, pick, unknown_name_message
from reroll.algorithms.shaping import REWARD_NORMS

__all__ = [
    "ALIASES",
    "UnknownAlgorithmError",
    "lookup",
    "lookup_table",
    "names",
    "tables",
    "unknown_name_message",
]

TABLES: dict[str, dict[str, Callable[..., Any]]] = {
    "adv_estimator": ADV_ESTIMATORS,
    "policy_loss": POLICY_LOSSES,
    "kl_estimator": KL_ESTIMATORS,
    "loss_agg_mode": LOSS_AGG_MODES,
    "reward_norm": REWARD_NORMS,
}


def tables() -> dict[str, dict[str, Callable[..., Any]]]:
    """Every kind's name -> function table."""
    return TABLES


def names(kind: str) -> list[str]:
    """The valid names of one kind."""
    return list(lookup_table(kind))


def lookup_table(kind: str) -> dict[str, Callable[..., Any]]:
    """The name -> function table of one kind."""
    if kind not in TABLES:
        raise UnknownAlgorithmError(unknown_name_message("algorithm kind", kind, list(TABLES)))
    return TABLES[kind]


def lookup(kind: str, name: str) -> Callable[..., Any]:
    """The function registered as ``name`` under ``kind``; ``UnknownAlgorithmError`` lists the valid names."""
    return pick(kind, lookup_table(kind), name)
