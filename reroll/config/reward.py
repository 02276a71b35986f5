"""The reward section: one reward function, or several domains each with its own weighted rewards.

Simple case::

    reward: {fn: exact_match}

Mixed domains (rows carry a ``domain`` field; each domain sets its share of a step's prompts)::

    reward:
      domains:
        math: {share: 0.5, rewards: [{fn: math_verify}, {fn: think_format, weight: 0.1}]}
        code: {share: 0.3, rewards: [{fn: code_tests, args: {all_or_nothing: true}}]}
        chat: {share: 0.2, tags: [ifeval, if], rewards: [{fn: ifeval}]}

A trained reward model served as the ``learned_reward`` role (RLHF; ``fn`` still scores the evaluation)::

    reward:
      fn: exact_match
      model: {path: runs/reward-model/checkpoints/step_000300/model}

An LLM judge served by one of reroll's engines, as the ``judge`` role (placed by ``roles.judge``)::

    reward:
      fn: engine_judge
      args: {max_score: 10, parse_error_score: 0.0}
      judge: {model_path: Qwen/Qwen2.5-7B-Instruct, engine: vllm, max_new_tokens: 256}
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, field_validator

from reroll.config.base import StrictModel
from reroll.config.tags import tag_problems

log = logging.getLogger(__name__)

# reward names that were renamed: the old one still works, with a one-line deprecation message
RENAMED_FNS = {"reward_model": "classifier_score"}  # one name per thing: reward_model is a pipeline too


def renamed_fn(name: str) -> str:
    """``name``, or the new name of a renamed reward (said once per load)."""
    if name in RENAMED_FNS:
        log.warning("reward fn %r is now %r; the old name still works", name, RENAMED_FNS[name])
        return RENAMED_FNS[name]
    return name


Isolation = Literal["auto", "thread", "process"]
ISOLATION_DOC = (
    "Where each call runs: 'thread' (in the reward worker; a hung call cannot be stopped), 'process' "
    "(a child process, killed at sample_timeout_s; costs a pickle round trip per call), 'auto' "
    "(process for a 'package.module:function' reward, thread for a registered one)."
)


class RewardTermConfig(StrictModel):
    """One reward function of a domain and its weight in the domain's weighted sum."""

    fn: str = Field(description="A registered reward name or 'package.module:function'.")
    weight: float = Field(1.0, description="Multiplies this reward's score in the domain's sum.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the function (e.g. {all_or_nothing: true})."
    )
    isolation: Isolation = Field("auto", description=ISOLATION_DOC)

    @field_validator("fn")
    @classmethod
    def _renamed(cls, name: str) -> str:
        return renamed_fn(name)


class RewardDomainConfig(StrictModel):
    """A domain: which row tags belong to it, how it is scored, and its share of each step's prompts."""

    rewards: list[RewardTermConfig] = Field(
        min_length=1, description="Weighted rewards summed into the score."
    )
    tags: list[str] = Field(
        default_factory=list, description="Row `domain` values routed here (default: the domain's own name)."
    )
    share: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Fraction of each step's prompts drawn from this domain; set for all domains or none "
        "(none: prompts are drawn from all rows alike).",
    )
    normalize: Literal["none", "batch"] = Field(
        "none",
        description="'batch': rewards standardised (mean 0, std 1) within this domain's samples of the step, "
        "before the algorithm's own shaping.",
    )


class JudgeConfig(StrictModel):
    """The model behind ``engine_judge`` rewards, served by reroll's own engine as the ``judge`` role."""

    model_path: str = Field(description="Hub id or local directory of the judge model.")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Generation engine; 'vllm' takes its settings from rollout.vllm."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    max_new_tokens: int = Field(256, ge=1, description="Longest judge reply, in tokens (greedy decoding).")
    chat_template: bool = Field(
        True,
        description="Wrap the judge prompt in the tokenizer's chat template as a user turn, as a "
        "chat-completions server does (if the tokenizer has one).",
    )
    batch_size: int = Field(32, ge=1, description="Sequences per engine call inside a judge worker.")


class LearnedRewardConfig(StrictModel):
    """A trained reward model served as the ``learned_reward`` role (placed by roles.learned_reward): it scores
    whole responses in batches on its own devices (or colocated ones) for an rlvr run (RLHF)."""

    path: str = Field(
        description="Local directory or hub id of an AutoModelForSequenceClassification checkpoint with one "
        "label (what `pipeline: reward_model` writes), with its tokenizer."
    )
    template: str = Field(
        "{prompt}{response}",
        description="The text the reward model scores, over {prompt} and {response}; the score is its output "
        "at the last token.",
    )
    append_eos: bool = Field(
        True,
        description="Append the reward model tokenizer's eos token to the text, as `pipeline: reward_model` "
        "trains (prompt + response + eos): the score is read at the eos.",
    )
    max_length: int = Field(
        1024,
        ge=1,
        description="Longest text scored, in the reward model's tokens; longer texts keep their end.",
    )
    weight: float = Field(
        1.0, description="The training reward is weight * score + rule_weight * reward.fn's score."
    )
    rule_weight: float = Field(
        0.0,
        description="Weight of reward.fn's score in the training reward (0: the rule reward is only measured, "
        "as rollout/accuracy and eval/accuracy).",
    )


class RewardConfig(StrictModel):
    """Which rewards score responses, and how reward workers run them."""

    fn: str = Field("exact_match", description="A registered reward name or 'package.module:function'.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword options of `fn`.")
    isolation: Isolation = Field("auto", description=ISOLATION_DOC)
    domains: dict[str, RewardDomainConfig] = Field(
        default_factory=dict,
        description="Per-domain rewards, shares and normalisation (replaces fn/args when set).",
    )
    default_domain: str | None = Field(
        None, description="Domain for rows whose tag no domain lists (None: such a row is an error)."
    )
    judge: JudgeConfig | None = Field(
        None, description="The judge model of `engine_judge` rewards (starts the `judge` role)."
    )
    model: LearnedRewardConfig | None = Field(
        None,
        description="A trained reward model (starts the `learned_reward` role, pipeline rlvr): the training "
        "reward becomes model.weight x its score + model.rule_weight x the rewards above, which still score "
        "the held-out evaluation (RLHF).",
    )
    threads: int = Field(
        4, ge=1, description="Reward calls run concurrently in each reward worker (and its reward processes)."
    )
    sample_timeout_s: float = Field(
        30.0, gt=0, description="Longest one reward call may take; past it the sample gets error_score."
    )
    error_score: float = Field(0.0, description="Score of a reward call that raised or timed out.")
    max_error_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Stop the run (exit code 2, with the first error's type, message and reward) when more "
        "than this share of one call's samples (a step's rewards, an evaluation) raised, and whenever all "
        "of them failed. Timeouts are counted apart (reward/timeouts) and not in this share, since a slow "
        "call can be the response's doing; a call where every sample raised or timed out stops the run "
        "too. 1.0: stop only when all failed.",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Slack on a worker's whole call: it fails the step after "
        "timeout_s + ceil(items / threads) * sample_timeout_s.",
    )

    @field_validator("fn")
    @classmethod
    def _renamed(cls, name: str) -> str:
        return renamed_fn(name)


def check_reward(cfg: RewardConfig) -> list[tuple[str, str]]:
    """``(dotted path, reason)`` for each problem of the reward section."""
    problems = _check_judge(cfg)
    if not cfg.domains:
        if cfg.default_domain is not None:
            problems.append(("reward.default_domain", "is only used with reward.domains; remove it"))
        return problems
    given = cfg.changed_fields() & {"fn", "args", "isolation"}
    if given:
        problems.append(
            (
                f"reward.{sorted(given)[0]}",
                "set either reward.fn/args/isolation (one reward for every row) or reward.domains, not both: "
                "move the reward into a domain's rewards list",
            )
        )
    shares = {name: d.share for name, d in cfg.domains.items()}
    if any(s is not None for s in shares.values()):
        missing = [n for n, s in shares.items() if s is None]
        if missing:
            problems.append(("reward.domains", f"share is set for some domains but not for {missing}"))
        elif abs(sum(shares.values()) - 1.0) > 1e-6:
            problems.append(
                ("reward.domains", f"the shares {shares} add up to {sum(shares.values()):g}, not 1")
            )
    tags = {name: d.tags for name, d in cfg.domains.items()}
    return problems + tag_problems(tags, cfg.default_domain, "reward.domains", "reward.default_domain")


def _check_judge(cfg: RewardConfig) -> list[tuple[str, str]]:
    terms = (
        {
            f"reward.domains.{n}.rewards[{i}]": t
            for n, d in cfg.domains.items()
            for i, t in enumerate(d.rewards)
        }
        if cfg.domains
        else {"reward": RewardTermConfig(fn=cfg.fn, args=cfg.args, isolation=cfg.isolation)}
    )
    judged = {path: t for path, t in terms.items() if t.fn == "engine_judge"}
    problems = [
        (
            f"{path}.isolation",
            "engine_judge calls the judge role from the reward worker: use 'thread' or 'auto'",
        )
        for path, t in judged.items()
        if t.isolation == "process"
    ]
    if judged and cfg.judge is None:
        problems.append(
            (
                "reward.judge",
                f"{sorted(judged)[0]} is engine_judge, which needs reward.judge: {{model_path: ...}}",
            )
        )
    if cfg.judge is not None and not judged:
        problems.append(
            ("reward.judge", "is set but no reward is engine_judge: remove reward.judge or use the judge")
        )
    return problems
