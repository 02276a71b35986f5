"""The reward section: one reward function, or several domains each with its own weighted rewards.

Simple case::

    reward: {fn: exact_match}

Mixed domains (rows carry a ``domain`` field; each domain sets its share of a step's prompts)::

    reward:
      domains:
        math: {share: 0.5, rewards: [{fn: math_verify}, {fn: think_format, weight: 0.1}]}
        code: {share: 0.3, rewards: [{fn: code_tests, args: {all_or_nothing: true}}]}
        chat: {share: 0.2, tags: [ifeval, if], rewards: [{fn: ifeval}]}
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from reroll.config.base import StrictModel


class RewardTermConfig(StrictModel):
    """One reward function of a domain and its weight in the domain's weighted sum."""

    fn: str = Field(description="A registered reward name or 'package.module:function'.")
    weight: float = Field(1.0, description="Multiplies this reward's score in the domain's sum.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the function (e.g. {all_or_nothing: true})."
    )


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


class RewardConfig(StrictModel):
    """Which rewards score responses, and how reward workers run them."""

    fn: str = Field("exact_match", description="A registered reward name or 'package.module:function'.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword options of `fn`.")
    domains: dict[str, RewardDomainConfig] = Field(
        default_factory=dict,
        description="Per-domain rewards, shares and normalisation (replaces fn/args when set).",
    )
    default_domain: str | None = Field(
        None, description="Domain for rows whose tag no domain lists (None: such a row is an error)."
    )
    threads: int = Field(4, ge=1, description="Reward calls run concurrently in each reward worker.")
    sample_timeout_s: float = Field(
        30.0, gt=0, description="Longest one reward call may take; past it the sample gets error_score."
    )
    error_score: float = Field(0.0, description="Score of a reward call that raised or timed out.")
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Slack on a worker's whole call: it fails the step after "
        "timeout_s + ceil(items / threads) * sample_timeout_s.",
    )


def check_reward(cfg: RewardConfig) -> list[tuple[str, str]]:
    """``(dotted path, reason)`` for each problem of the reward section."""
    if not cfg.domains:
        if cfg.default_domain is not None:
            return [("reward.default_domain", "is only used with reward.domains; remove it")]
        return []
    problems = []
    given = cfg.model_fields_set & {"fn", "args"}
    if given:
        problems.append(
            (
                f"reward.{sorted(given)[0]}",
                "set either reward.fn/args (one reward for every row) or reward.domains, not both: "
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
    seen: dict[str, str] = {}
    for name, d in cfg.domains.items():
        for tag in d.tags or [name]:
            if tag in seen:
                problems.append(
                    (f"reward.domains.{name}.tags", f"tag {tag!r} is also routed to {seen[tag]!r}")
                )
            seen[tag] = name
    if cfg.default_domain is not None and cfg.default_domain not in cfg.domains:
        problems.append(
            (
                "reward.default_domain",
                f"{cfg.default_domain!r} is not one of the domains {sorted(cfg.domains)}",
            )
        )
    return problems
