"""External agent code as an environment: ``agentic.env: "agent:package.module:function"``.

The agent is any Python function that plays one episode by talking to an OpenAI-compatible chat
endpoint, as agent code written for a hosted model does:

    def run(base_url: str, task: dict, **options) -> float | RewardResult:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        ...  # any number of chat.completions.create(...) calls, tools, parsing, checking
        return reward

During training ``base_url`` is an endpoint that reroll serves for that one episode: every call is
answered by actor_infer, and reroll records the tokens it sent and received, so the episode is
trained on exactly what the policy generated. ``task`` is the episode's row (``agentic.tasks``; the
row's fields plus ``seed``), ``options`` are ``agentic.env_config``. The return value is the
episode's reward: a number, or a ``RewardResult`` (``details["success"]`` says whether the episode
succeeded; without it a positive reward counts as success). An agent that raises ends its episode
with the error recorded, as an environment that raises does.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reroll.errors import UserError
from reroll.rewards.base import RewardResult

PREFIX = "agent:"

AgentFn = Callable[..., Any]


def is_agent(env: str) -> bool:
    """Whether ``agentic.env`` names external agent code rather than an environment."""
    return env.startswith(PREFIX)


def load_agent(env: str, options: Mapping[str, Any]) -> AgentFn:
    """The agent function ``agent:package.module:function`` names, checked to accept
    ``(base_url, task, **options)``; anything wrong is a ``UserError`` saying what to fix."""
    target = env[len(PREFIX) :]
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise UserError(
            f"{env!r}: write an agent as 'agent:package.module:function', e.g. 'agent:my_agents.solver:run'"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(
            f"agent {target!r} cannot be imported ({e}); the module must be importable "
            "from the directory you run reroll in (or on PYTHONPATH)"
        ) from e
    if not callable(fn):
        raise UserError(f"agent {target!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("http://host/v1", {}, **options)
    except TypeError as e:
        raise UserError(
            f"agent {target}(base_url, task, **agentic.env_config) does not bind ({e}); "
            f"the options given were {sorted(options) or 'none'}"
        ) from e
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return fn


@dataclass
class AgentOutcome:
    """What one agent run ended with: its reward and whether it succeeded, or the error it raised."""

    reward: float = 0.0
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def outcome(value: Any) -> AgentOutcome:
    """An agent's return value as an ``AgentOutcome``: a number, a bool, or a ``RewardResult``."""
    details: Mapping[str, Any] = {}
    if isinstance(value, RewardResult):
        value, details = value.score, value.details
    if not isinstance(value, (int, float)):  # bool is an int: True scores 1
        return AgentOutcome(
            error=f"the agent returned {type(value).__name__}; return a number or a RewardResult"
        )
    reward = float(value)
    if not math.isfinite(reward):
        return AgentOutcome(error=f"the agent returned a reward of {reward}; return a finite number")
    info = {k: v for k, v in details.items() if isinstance(v, (bool, int, float, str))}
    success = bool(info["success"]) if "success" in info else reward > 0
    return AgentOutcome(reward, success, info)


def play(fn: AgentFn, base_url: str, task: Mapping[str, Any], options: Mapping[str, Any]) -> AgentOutcome:
    """Run the agent on one task; an exception it raises becomes the outcome's ``error``."""
    try:
        return outcome(fn(base_url, dict(task), **options))
    except Exception as e:
        return AgentOutcome(error=f"{type(e).__name__}: {e}")
