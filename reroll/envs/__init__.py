"""Multi-turn environments (text in, text out) and the tools an environment may offer the policy.

The interface is GEM's (``pip install gem-llm``): ``reset(seed) -> (observation, info)`` and
``step(action_text) -> (observation, reward, terminated, truncated, info)``, so a GEM environment
runs unchanged as ``gem:<id>``. ``make_env(name, config)`` builds a registered one; ``env_names()``
lists them.
"""

from reroll.envs.base import Env, StepResult
from reroll.envs.registry import env_names, make_env

__all__ = ["Env", "StepResult", "env_names", "make_env"]
