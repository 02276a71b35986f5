"""Environments by name: reroll's own, ``gem:<id>`` (``reroll.envs.gem``), or ``package.module:Factory``.

``make_env(name, config)`` checks ``config`` against the factory's keyword arguments, so a typo is an
error that lists the accepted keys with their defaults; an unknown name lists the registered ones.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from reroll.envs.base import Env
from reroll.errors import UserError

# name -> "module:factory"; factories are imported on first use
_REGISTRY: dict[str, str] = {
    "nim": "reroll.envs.nim:Nim",
    "frozenlake": "reroll.envs.frozenlake:FrozenLake",
    "sokoban": "reroll.envs.sokoban:Sokoban",
    "tool_math": "reroll.envs.tool_math:ToolMath",
}


def env_names() -> list[str]:
    """The registered names (``gem:<id>`` and ``module:Factory`` names are accepted besides these)."""
    return sorted(_REGISTRY)


def register_env(name: str, factory: str) -> None:
    """Register ``factory`` (``"package.module:Factory"``) under ``name``."""
    _REGISTRY[name] = factory


def make_env(name: str, config: Mapping[str, Any] | None = None) -> Env:
    """A fresh environment; ``config`` holds the factory's keyword arguments (strictly checked)."""
    config = dict(config or {})
    if name.startswith("gem:"):
        return _make_gem(name[4:], config)
    if name.startswith("agent:"):
        raise UserError(
            f"{name!r} is agent code, not an environment with reset/step: it plays whole episodes against an "
            "endpoint during training (docs/serve.md); `reroll validate` checks that it imports and binds"
        )
    target = _REGISTRY.get(name) or (name if ":" in name else None)
    if target is None:
        close = difflib.get_close_matches(name, env_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(
            f"unknown environment {name!r}{hint}: registered are {', '.join(env_names())}; "
            "use 'gem:<id>' for a GEM environment or 'package.module:Factory' for your own"
        )
    factory = _import(target, name)
    _check_config(name, factory, config)
    try:
        return factory(**config)
    except ValueError as e:
        raise UserError(f"environment {name!r}: {e}") from e


def _import(target: str, name: str) -> Callable[..., Env]:
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"environment {name!r}: cannot import {target!r} ({e})") from e


def _check_config(name: str, factory: Callable[..., Any], config: dict[str, Any]) -> None:
    params = inspect.signature(factory).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    accepted = {
        k: p.default for k, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    unknown = [k for k in config if k not in accepted]
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in accepted.items()) or "none"
        raise UserError(f"environment {name!r} has no option {unknown[0]!r}; its options are {listed}")


def _make_gem(env_id: str, config: dict[str, Any]) -> Env:
    from reroll.envs.gem import make_gem_env  # numpy and GEM only for GEM's environments

    return make_gem_env(env_id, config)
