"""Tail batching after RollPacker: long responses are set aside and finished together in a later step.

A synchronous step waits for its longest response. With ``rollout.tail_threshold: L`` an ordinary
step generates at most ``L`` tokens per response. A group with a response cut there (it reached ``L``
tokens without finishing) is set aside whole, its cut responses kept as they are (prompt plus the
tokens produced so far, with their log-probs and the policy version of every token), and the step
trains on the groups that finished. Once ``prompts_per_step`` groups are set aside, the next step is
a **tail step**: it continues every cut response of those groups from its tokens (the engine takes
prompt + partial response as token ids) up to ``rollout.max_new_tokens`` with the engine's current
weights, and trains on them. So ordinary steps cost ``L`` tokens of decoding, and the long responses
share the tail steps. ``rollout.tail_share`` bounds what an ordinary step may set aside: past that
share of its groups, the step finishes the rest of its cut responses itself, so its batch never
shrinks below ``1 - tail_share`` of ``rollout.batch_size``.

Every sample is trained once: a cut response is continued, not dropped. The continued tokens come from
newer weights than the first ``L`` (``staleness/*`` shows it; importance sampling corrects it when
``algorithm.rollout_is`` is on). Logged: ``tail/step`` (1 on a tail step), ``tail/deferred_groups``,
``tail/pending_groups``, ``tail/deferred_share`` and ``tail/finished_in_step`` (groups past the
share, finished in their own step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from reroll.config.schema import RunConfig
from reroll.data.types import Completion, Sample, field_values
from reroll.pipelines.common import sampling
from reroll.pipelines.roles import Roles


@dataclass
class Partial:
    """A group generated so far: its completions, some maybe cut at the threshold, and the policy
    version of each response token."""

    sample: Sample
    completions: list[Completion]
    versions: list[list[int]]

    def cut(self, threshold: int) -> list[int]:
        """Indices of the completions cut at ``threshold`` (not finished)."""
        return [
            i
            for i, c in enumerate(self.completions)
            if c.finish_reason == "length" and len(c.response_ids) >= threshold
        ]

    def to_state(self) -> dict[str, Any]:
        return {
            "sample": field_values(self.sample),
            "completions": [field_values(c) for c in self.completions],
            "versions": self.versions,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Partial:
        comps = [Completion(**c) for c in state["completions"]]
        return cls(Sample(**state["sample"]), comps, [list(v) for v in state["versions"]])


def tail_seed(cfg: RunConfig, step: int) -> int:
    """The sampling seed of the continuations made at ``step`` (apart from the step's own rounds)."""
    return (cfg.seed * 1_000_003 + step) * 31 + 17


def partials(prompts: list[Sample], groups: list[list[Completion]], version: int) -> list[Partial]:
    """Freshly generated groups, every token of policy ``version``."""
    return [
        Partial(s, comps, [[version] * len(c.response_ids) for c in comps])
        for s, comps in zip(prompts, groups)
    ]


class TailBatcher:
    """The groups set aside for a tail step (``pending``), and the two moves: ``defer`` after an
    ordinary step's generation, ``finish`` on a tail step."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.threshold = cfg.rollout.tail_threshold or cfg.rollout.max_new_tokens
        self.pending: list[Partial] = []
        self.engine_version = 0  # set by the rollout source: the version the engine's new tokens carry

    @property
    def enabled(self) -> bool:
        return self.cfg.rollout.tail_threshold is not None

    def tail_step_due(self) -> bool:
        return self.enabled and len(self.pending) >= self.cfg.prompts_per_step

    def max_new_tokens(self) -> int:
        """What an ordinary step generates per response."""
        return self.threshold

    def defer(self, roles: Roles, step: int, groups: list[Partial]) -> tuple[list[Partial], dict[str, float]]:
        """Set aside the groups with a cut response (up to ``tail_share`` of them, the first in order);
        finish the others' cut responses now. Returns the groups the step trains on, in order."""
        long = [i for i, g in enumerate(groups) if g.cut(self.threshold)]
        allowed = math.floor(self.cfg.rollout.tail_share * len(groups))
        deferred, finish_now = long[:allowed], long[allowed:]
        self.pending += [groups[i] for i in deferred]
        if finish_now:
            done = self._continue(roles, step, [groups[i] for i in finish_now])
            groups = [done[finish_now.index(i)] if i in finish_now else g for i, g in enumerate(groups)]
        kept = [g for i, g in enumerate(groups) if i not in deferred]
        return kept, {
            "tail/step": 0.0,
            "tail/deferred_groups": float(len(deferred)),
            "tail/deferred_share": len(deferred) / max(1, len(groups)),
            "tail/finished_in_step": float(len(finish_now)),
            "tail/pending_groups": float(len(self.pending)),
        }

    def finish(self, roles: Roles, step: int) -> tuple[list[Partial], dict[str, float]]:
        """A tail step: the first ``prompts_per_step`` groups set aside, their cut responses continued."""
        take, self.pending = (
            self.pending[: self.cfg.prompts_per_step],
            self.pending[self.cfg.prompts_per_step :],
        )
        done = self._continue(roles, step, take)
        return done, {
            "tail/step": 1.0,
            "tail/deferred_groups": 0.0,
            "tail/deferred_share": 0.0,
            "tail/finished_in_step": 0.0,
            "tail/pending_groups": float(len(self.pending)),
        }

    def _continue(self, roles: Roles, step: int, groups: list[Partial]) -> list[Partial]:
        """Every cut response of ``groups`` continued from its tokens to ``rollout.max_new_tokens``
        with the engine's current weights (``engine_version`` stamps the new tokens)."""
        cuts = [(g, i) for g in groups for i in g.cut(self.threshold)]
        budget = self.cfg.rollout.max_new_tokens - self.threshold
        params = replace(sampling(self.cfg, n=1, seed=tail_seed(self.cfg, step)), max_new_tokens=budget)
        rows = [g.completions[i].prompt_ids + g.completions[i].response_ids for g, i in cuts]
        with roles.phase("generate_tail", "actor_infer"):
            more = [c[0] for c in roles.actor_infer.generate(rows, params)] if rows else []
        out = {id(g): Partial(g.sample, list(g.completions), [list(v) for v in g.versions]) for g in groups}
        for (g, i), extra in zip(cuts, more):
            part = out[id(g)]
            part.completions[i] = g.completions[i].continued(extra)
            part.versions[i] = part.versions[i] + [self.engine_version] * len(extra.response_ids)
        return [out[id(g)] for g in groups]

    def state(self) -> list[dict[str, Any]]:
        return [p.to_state() for p in self.pending]

    def restore(self, state: list[dict[str, Any]]) -> None:
        self.pending = [Partial.from_state(p) for p in state]
