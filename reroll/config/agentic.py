"""The agentic pipeline's section (``agentic``): the environment and its episodes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from reroll.config.base import StrictModel


class AgenticConfig(StrictModel):
    """Multi-turn episodes against an environment (pipeline 'agentic'); rollout.batch_size episodes per
    step, rollout.group_size of them per seed, rollout.max_new_tokens per turn."""

    env: str = Field(
        description="Environment: a registered name (`reroll env-check --list`), 'gem:<id>', 'module:Factory', "
        "or 'agent:module:function' for agent code that talks to an OpenAI-compatible endpoint (docs/serve.md)."
    )
    env_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the environment (of the agent function, for 'agent:').",
    )
    tasks: str | None = Field(
        None,
        description="'agent:' environments: JSONL/JSON/Parquet rows handed to the agent, row seed % rows for "
        "episode seed (with the row's 'seed' set); without it the task is {'seed': seed}.",
    )
    eval_tasks: str | None = Field(
        None, description="'agent:' environments: the held-out rows, one per evaluation episode (else tasks)."
    )
    agent_timeout_s: float = Field(
        600.0,
        gt=0,
        description="'agent:' environments: an agent run (the whole episode) past this ends with an error (recorded).",
    )
    system_prompt: str | None = Field(None, description="A system message before the first observation.")
    max_turns: int = Field(
        8, ge=1, description="Policy turns per episode; an episode still running is truncated."
    )
    max_episode_tokens: int = Field(
        1024,
        ge=1,
        description="Token budget of a whole episode (prompt, turns, observations); past it, truncated.",
    )
    step_timeout_s: float = Field(
        30.0, gt=0, description="A reset or step slower than this ends its episode with an error (recorded)."
    )
    streaming: bool = Field(
        False,
        description="Episodes advance independently: an episode's next turn goes to the engine as soon as its "
        "environment answers, environment steps run concurrently (false: all live episodes turn in lockstep).",
    )
    batch_wait_s: float = Field(
        0.05,
        ge=0,
        description="streaming: how long the engine waits for other episodes' turns after the first arrives "
        "(it starts at once when every live episode waits); what a slow environment can stall the others.",
    )
    error_policy: Literal["drop", "zero"] = Field(
        "drop",
        description="Episodes that ended in an environment error: 'drop' from training, or train them with reward 0.",
    )
    eval_episodes: int = Field(100, ge=0, description="Held-out episodes (greedy) per evaluation.")
    eval_seed: int = Field(
        1_000_000, ge=0, description="First seed of the held-out episodes (training seeds are below)."
    )
    sft_policy: Literal["scripted", "random"] = Field(
        "scripted", description="The environment's policy that plays the SFT warm start's episodes."
    )
    sft_noise: float = Field(
        0.0,
        ge=0,
        le=1,
        description="In the warm start, the share of turns played by the random policy instead.",
    )
