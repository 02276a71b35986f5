"""Routing rows to domains, and a domain's weighted rewards summed into one result.

A row's tag (its ``domain`` field, ``Sample.domain``) picks the domain; the domain's rewards run in
order and their scores are summed with their weights. With no ``reward.domains`` every row belongs
to the single domain ``default``, scored by ``reward.fn``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from reroll.algorithms.shaping import batch_normalize
from reroll.config.reward import RewardConfig, RewardTermConfig
from reroll.config.tags import route_tag, tag_owners
from reroll.errors import RewardFailure, RoleError, UserError
from reroll.rewards import REGISTRY, required_fields, resolve_reward
from reroll.rewards.base import RewardResult, as_result
from reroll.rewards.calling import describe_error
from reroll.rewards.isolation import ProcessPool, RewardCallError, RewardTimeout

DEFAULT_DOMAIN = "default"
_FAILURES = ("reward_error", "reward_timeout")  # details set by the reward worker on a failed call


def domain_terms(cfg: RewardConfig) -> dict[str, list[RewardTermConfig]]:
    """Each domain's reward terms; the single-reward config is the one domain ``default``."""
    if not cfg.domains:
        return {DEFAULT_DOMAIN: [RewardTermConfig(fn=cfg.fn, args=cfg.args, isolation=cfg.isolation)]}
    return {name: d.rewards for name, d in cfg.domains.items()}


def term_key(cfg: RewardConfig, domain: str, index: int) -> str:
    """The config key of a domain's ``index``-th reward: ``reward`` or ``reward.domains.<d>.rewards[i]``."""
    return f"reward.domains.{domain}.rewards[{index}]" if cfg.domains else "reward"


def route(cfg: RewardConfig, tag: str) -> str:
    """The domain a row tagged ``tag`` belongs to."""
    if not cfg.domains:
        return DEFAULT_DOMAIN
    tags = {name: d.tags for name, d in cfg.domains.items()}
    domain = route_tag(tags, tag, cfg.default_domain)
    if domain is not None:
        return domain
    known = tag_owners(tags)
    raise UserError(
        f"a row is tagged domain {tag!r}, which no reward domain lists (tags: {known}): add it to a "
        f"domain's tags, or set reward.default_domain"
    )


def domain_required_fields(cfg: RewardConfig) -> dict[str, list[str]]:
    """The row fields each domain's registered rewards read."""
    return {
        name: list(dict.fromkeys(f for t in terms for f in required_fields(t.fn)))
        for name, terms in domain_terms(cfg).items()
    }


def runs_isolated(term: RewardTermConfig) -> bool:
    """Whether ``term`` runs in a child process: ``isolation`` 'process', or 'auto' for a user's
    ``package.module:function`` (registered rewards are reroll's own and bounded, the code sandbox
    included)."""
    if term.isolation == "auto":
        return term.fn not in REGISTRY
    return term.isolation == "process"


class RewardTermError(Exception):
    """A reward function raised (or its process died): the message names its config key, the function,
    the error's type and text and where the user's code raised it, e.g. ``reward.fn 'mod:f' raised
    TypeError: ... (at mod.py, line 3, in f)``. ``kind`` is the message without the error's text (one
    per bug, however the text varies with the input), ``traceback_text`` the full traceback."""

    def __init__(self, message: str, kind: str, traceback_text: str) -> None:
        super().__init__(message)
        self.kind, self.traceback_text = kind, traceback_text

    def __reduce__(self) -> tuple:
        return (RewardTermError, (str(self), self.kind, self.traceback_text))


@dataclass(frozen=True)
class _Term:
    name: str
    fn: Callable[..., RewardResult]
    weight: float
    args: Mapping[str, Any]
    isolated: bool
    key: str  # where the config sets it, for errors


class RewardRouter:
    """Scores one (prompt, response, row, tag) with the tag's domain's weighted rewards.

    With a ``pool``, terms whose isolation is 'process' (see ``runs_isolated``) run in it, killed at
    ``deadline``; without one, every term runs in the calling thread. ``judge`` is what
    ``engine_judge`` rewards call (the judge role's ``JudgeClient``).
    """

    def __init__(
        self, cfg: RewardConfig, pool: ProcessPool | None = None, judge: Callable[[str], str] | None = None
    ) -> None:
        self.cfg, self.pool = cfg, pool
        self.terms = {
            name: [
                _Term(
                    t.fn,
                    resolve_reward(t.fn, _with_judge(t, judge)),
                    t.weight,
                    t.args,
                    pool is not None and runs_isolated(t),
                    f"{term_key(cfg, name, i)}.fn",
                )
                for i, t in enumerate(terms)
            ]
            for name, terms in domain_terms(cfg).items()
        }

    def score(
        self, prompt: str, response: str, row: Mapping[str, Any], tag: str, *, deadline: float | None = None
    ) -> RewardResult:
        terms = self.terms[route(self.cfg, tag)]

        def run(t: _Term) -> RewardResult:
            try:
                if not t.isolated:
                    return as_result(t.fn(prompt, response, row))
                assert self.pool is not None and deadline is not None, "an isolated term needs a deadline"
                return as_result(self.pool.call(t.name, t.args, prompt, response, row, deadline=deadline))
            except (
                RewardTimeout,
                RoleError,
            ):  # a timeout is counted apart; the judge role's failure is its own
                raise
            except Exception as e:
                what = _what_failed(t.name, e)
                kind = f"{t.key} {t.name!r} {what.split(':', 1)[0]}{_location(what)}"
                text = getattr(e, "traceback_text", "") or "".join(traceback.format_exception(e))
                raise RewardTermError(f"{t.key} {t.name!r} {what}", kind, text) from e

        if len(terms) == 1 and terms[0].weight == 1.0:
            return run(terms[0])
        return combine([(t.name, t.weight, run(t)) for t in terms])


def _what_failed(name: str, e: Exception) -> str:
    """``raised Type: text (at file, line N, in f)`` (a process-isolated call's error says so in its
    own words)."""
    if isinstance(e, RewardCallError):
        text = str(e).removeprefix(f"reward {name!r}").lstrip(": ")
        return text if text.startswith("raised ") else f"failed: {text}"
    return f"raised {describe_error(e)}"


def _location(what: str) -> str:
    """The `` (at file, line N, in f)`` that ends ``describe_error``'s text, or ''."""
    _, sep, where = what.rpartition(" (at ")
    return f" (at {where}" if sep and where.endswith(")") else ""


def check_failures(results: Sequence[RewardResult], cfg: RewardConfig, phase: str) -> None:
    """Raise ``RewardFailure`` when more than ``cfg.max_error_share`` of ``results`` are reward calls that
    raised, or when every one raised or timed out (nothing was scored). Timeouts are not in the share."""
    n = len(results)
    errors = [r for r in results if r.details.get("reward_error")]
    timeouts = sum(1 for r in results if r.details.get("reward_timeout"))
    first = str(errors[0].details.get("reward_error_message", "(no message)")) if errors else ""
    if n and len(errors) + timeouts == n:
        if not errors:
            first = (
                f"every call passed reward.sample_timeout_s={cfg.sample_timeout_s:g}s: raise it, or make "
                f"the reward faster"
            )
        rule = f"every sample failed: {len(errors)} raised, {timeouts} timed out"
        raise RewardFailure(phase, n, n, first, rule)
    if n and len(errors) / n > cfg.max_error_share:
        rule = f"more than reward.max_error_share={cfg.max_error_share:g}"
        rule += f"; {timeouts} more timed out" if timeouts else ""
        raise RewardFailure(phase, len(errors), n, first, rule)


def _with_judge(term: RewardTermConfig, judge: Callable[[str], str] | None) -> dict[str, Any]:
    if term.fn != "engine_judge":
        return term.args
    if judge is None:
        raise UserError("reward engine_judge needs the judge role: set reward.judge: {model_path: ...}")
    return {**term.args, "judge": judge}


def combine(parts: list[tuple[str, float, RewardResult]]) -> RewardResult:
    """The weighted sum of several rewards' scores. details: each reward's numeric details and score
    under ``<name>/<key>``, and ``correct`` 0/1 when every reward that reports one is correct."""
    details: dict[str, Any] = {}
    correct = [r.details["correct"] for _, _, r in parts if "correct" in r.details]
    for name, _, r in parts:
        details[f"{name}/score"] = r.score
        details |= {f"{name}/{k}": v for k, v in r.details.items() if isinstance(v, int | float)}
    if correct:
        details["correct"] = int(all(correct))
    return RewardResult(sum(w * r.score for _, w, r in parts), details)


def normalize_by_domain(rewards: Tensor, domains: Sequence[str], cfg: RewardConfig) -> Tensor:
    """Rewards (B,) with each ``normalize: batch`` domain's entries standardised over that domain's
    entries of the batch; the others unchanged."""
    out = rewards.clone()
    for name, d in cfg.domains.items():
        mask = torch.tensor([x == name for x in domains], dtype=torch.bool)
        if d.normalize == "batch" and mask.any():
            out = torch.where(mask, batch_normalize(rewards, mask), out)
    return out


def domain_metrics(
    domains: Sequence[str],
    results: Sequence[RewardResult],
    *,
    prefix: str = "reward",
    per_domain: bool = True,
) -> dict[str, float]:
    """``<prefix>/errors`` and ``/timeouts`` (counts of reward calls that raised / passed their
    deadline), and per domain ``<prefix>/<domain>/mean``, ``/accuracy``, ``/share`` (fraction of the
    samples), ``/reward_errors`` and ``/reward_timeouts`` (counts) and every other numeric detail's
    mean. (Not ``<domain>/errors``: code_tests reports its sandbox runs' ``errors`` / ``timeouts``.)"""
    out = {
        f"{prefix}/errors": float(sum(r.details.get("reward_error", 0) for r in results)),
        f"{prefix}/timeouts": float(sum(r.details.get("reward_timeout", 0) for r in results)),
    }
    if not per_domain:
        return out
    for name in dict.fromkeys(domains):
        mine = [r for d, r in zip(domains, results) if d == name]
        out[f"{prefix}/{name}/mean"] = sum(r.score for r in mine) / len(mine)
        out[f"{prefix}/{name}/accuracy"] = sum(is_correct(r) for r in mine) / len(mine)
        out[f"{prefix}/{name}/share"] = len(mine) / len(results)
        for key in _FAILURES:
            out[f"{prefix}/{name}/{key}s"] = float(sum(r.details.get(key, 0) for r in mine))
        keys = {
            k
            for r in mine
            for k, v in r.details.items()
            if isinstance(v, int | float) and k not in ("correct", *_FAILURES)
        }
        for k in sorted(keys):
            values = [r.details[k] for r in mine if k in r.details]
            out[f"{prefix}/{name}/{k}"] = float(sum(values) / len(values))
    return out


def is_correct(result: RewardResult) -> bool:
    """A reward's own ``correct`` detail where it reports one, else a full score."""
    return bool(result.details.get("correct", result.score >= 1.0))
