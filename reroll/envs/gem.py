"""GEM's environments (the ``gem-llm`` package, ``pip install 'reroll[gem]'``) as ``agentic.env: gem:<id>``.

GEM's environments already have reroll's interface (``reroll.envs.base``); ``GemEnv`` adds what a
training run needs around one, each point found by running gem-llm 0.1.0's games:

- **Its own random numbers.** GEM's games draw from Python's and NumPy's global generators, and
  ``reset(seed)`` reseeds those globals. An env worker runs its episodes' calls in threads of one
  process, so two resets could interleave and the same seed give two different games (measured on
  ``game:Sokoban-v0-easy``: 16 concurrent resets with seed 0 gave 2 distinct first observations), and an
  episode's moves would depend on the episodes beside it. Each ``GemEnv`` keeps its own generator
  states and runs every call under one process-wide lock with its states swapped in: the same seed
  and actions give the same episode, whatever else runs.
- **Success.** GEM's steps report no success flag, and its games end a failed episode with a
  positive partial reward (GuessTheNumber gives ``1 - distance / range`` at its last turn), which
  reroll would count as success. GEM's game rewards are shaped so that a solved game's rewards sum to
  ``LanguageGameReward.success_reward`` (1.0; the math, QA and code environments give 1.0 for a correct
  answer), so an episode succeeds when its return reaches 1.0 (``SUCCESS_RETURN``); an ``info["success"]``
  from GEM itself is kept.
- **Errors that say what to do**: gem-llm not installed (the extra), an unknown id (with the close
  ones), an option the environment does not take (GEM's games swallow unknown keywords silently), the
  NLTK word list the word games need (GEM downloads it at run time; an offline machine fails).
- GEM's import calls ``logging.basicConfig(level=INFO)``; the root logger is put back as it was.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import logging
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from reroll.errors import UserError
from reroll.packages import importable

GEM_VERSION = "0.1.0"  # pyproject.toml's `gem` extra pins it (a test keeps the two equal)
SUCCESS_RETURN = 1.0  # GEM's LanguageGameReward.success_reward: a solved game's return
_EPS = 1e-6

# GEM's environments draw from the process's global generators: one call at a time (module doc)
_GLOBAL_RNG = threading.Lock()
T = TypeVar("T")


def gem_missing() -> str | None:
    """Why ``gem:<id>`` environments cannot be built here (gem-llm not installed), with the install line."""
    if importable("gem"):
        return None
    if sys.version_info >= (3, 12, 1):  # the extra's marker leaves gem-llm out there
        return (
            f"GEM's environments need the gem-llm package, and gem-llm {GEM_VERSION} does not install on "
            f"Python {sys.version.split()[0]} (it declares Requires-Python <=3.12): use Python 3.10 or 3.11, "
            "then pip install 'reroll[gem]'"
        )
    return (
        "GEM's environments need the gem-llm package: "
        f"pip install 'reroll[gem]' (or pip install gem-llm=={GEM_VERSION})"
    )


def _import_gem() -> Any:
    """``import gem``, leaving the root logger as it was (GEM's import configures it)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import gem
    except ImportError as e:
        raise UserError(gem_missing() or f"GEM's environments: import gem failed: {e}") from e
    finally:
        root.handlers[:], root.level = handlers, level
    return gem


def gem_ids() -> list[str]:
    """Every id GEM registers (``game:GuessTheNumber-v0-easy``, ``math:...``), sorted."""
    return sorted(_import_gem().envs.registration.ENV_REGISTRY)


def gem_problem(env_id: str, config: dict[str, Any]) -> str | None:
    """What is wrong with ``gem:<env_id>`` and its options, found without building it (a math or QA
    environment loads its data set when built): an unknown id or option. None when nothing is, or when
    gem-llm is not installed (``gem_missing`` says that)."""
    if gem_missing():
        return None
    try:
        _spec(env_id, config)
    except UserError as e:
        return str(e)
    return None


def make_gem_env(env_id: str, config: dict[str, Any]) -> GemEnv:
    """``gem.make(env_id, **config)`` wrapped in ``GemEnv``; every failure is a ``UserError`` with the fix."""
    gem = _import_gem()
    _spec(env_id, config)
    rng = _fresh_rng()
    try:
        with _swapped(rng):  # GEM's constructors reset (and so reseed) the environment
            env = gem.make(env_id, **config)
    except Exception as e:  # GEM's own errors: a bad option value, a data set that does not load
        raise UserError(
            _nltk_hint(env_id) if _is_nltk(e) else f"environment 'gem:{env_id}': {type(e).__name__}: {e}"
        ) from e
    return GemEnv(env, env_id, rng)


class GemEnv:
    """One GEM environment with its own random numbers and a success flag (module doc); ``env`` is GEM's."""

    def __init__(self, env: Any, env_id: str, rng: list[Any] | None = None) -> None:
        self.env, self.env_id = env, env_id
        self._rng = rng if rng is not None else _fresh_rng()
        self._return = 0.0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """GEM's reset with this environment's generators; the same seed gives the same episode."""
        self._return = 0.0
        return self._call(self.env.reset, seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """GEM's step; on the last step ``info["success"]``: the episode's return reached 1.0."""
        obs, reward, terminated, truncated, info = self._call(self.env.step, action)
        reward = float(reward)
        self._return += reward
        terminated, truncated = bool(terminated), bool(truncated)
        if (terminated or truncated) and "success" not in info:
            info = {**info, "success": self._return >= SUCCESS_RETURN - _EPS}
        return obs, reward, terminated, truncated, info

    def sample_random_action(self) -> str:
        """GEM's random action for the current state (``reroll env-check``, ``agentic.sft_policy: random``)."""
        try:
            return self._call(self.env.sample_random_action)
        except NotImplementedError as e:
            raise UserError(
                f"GEM's environment 'gem:{self.env_id}' has no random policy (its sample_random_action is "
                "not implemented): play it with a model, or warm-start from your own data (sft.files)"
            ) from e

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            close()

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        with _swapped(self._rng):
            return fn(*args)


def _fresh_rng() -> list[Any]:
    """Python's and NumPy's generator states, seeded from the OS (what an unseeded GEM reset does)."""
    import numpy as np  # GEM's dependency, not reroll's

    return [random.Random().getstate(), np.random.RandomState().get_state()]


@contextlib.contextmanager
def _swapped(rng: list[Any]) -> Iterator[None]:
    """The global generators hold ``rng``'s states for the block (one block at a time); ``rng`` gets
    the states they end with, and the globals get theirs back."""
    import numpy as np

    with _GLOBAL_RNG:
        saved = random.getstate(), np.random.get_state()
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        try:
            yield
        finally:
            rng[:] = [random.getstate(), np.random.get_state()]
            random.setstate(saved[0])
            np.random.set_state(saved[1])


def _spec(env_id: str, config: dict[str, Any]) -> Any:
    """GEM's registration of ``env_id``; an unknown id or option is a ``UserError``."""
    registry = _import_gem().envs.registration.ENV_REGISTRY
    spec = registry.get(env_id)
    if spec is None:
        close = difflib.get_close_matches(env_id, list(registry), n=3, cutoff=0.6)
        games = sorted(i for i in registry if i.startswith("game:"))
        hint = (
            f"did you mean {' or '.join(repr(c) for c in close)}?"
            if close
            else f"its games are {', '.join(games)}"
        )
        raise UserError(
            f"GEM has no environment {env_id!r}: {hint} (`reroll env-check --list` lists every id, used as 'gem:<id>')"
        )
    _check_options(env_id, spec, config)
    return spec


def _check_options(env_id: str, spec: Any, config: dict[str, Any]) -> None:
    """An option GEM's class would swallow unread (a ``**_`` catch-all) is an error listing the options."""
    entry = spec.entry_point
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), name)
        except Exception as e:  # GEM reports a class that does not import when the env is made
            if _is_nltk(e):
                raise UserError(_nltk_hint(env_id)) from e
            return
    try:
        params = inspect.signature(entry).parameters
    except (TypeError, ValueError):
        return
    catch_all = [p for p in params.values() if p.kind is p.VAR_KEYWORD]
    if catch_all and catch_all[0].name != "_":  # a **kwargs that is read: GEM decides
        return
    named = {
        k: spec.kwargs.get(k, p.default)
        for k, p in params.items()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }
    unknown = [k for k in config if k not in named]
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in named.items())
        raise UserError(
            f"environment 'gem:{env_id}' has no option {unknown[0]!r} (GEM would ignore it); its options are "
            f"{listed}"
        )


def _is_nltk(e: Exception) -> bool:
    """NLTK's "Resource ... not found" (GEM's word games download NLTK's word list at run time)."""
    return isinstance(e, LookupError) and "nltk" in str(e).lower()


def _nltk_hint(env_id: str) -> str:
    return (
        f"environment 'gem:{env_id}' needs NLTK's word list, which GEM downloads at run time and could not "
        "download here: fetch it once on a machine with internet, `python -m nltk.downloader words`, and "
        "copy ~/nltk_data over (or set NLTK_DATA to a directory that holds it)"
    )
