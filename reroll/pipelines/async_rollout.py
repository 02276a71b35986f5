"""Where an RLVR step's scored samples come from: generated now, or generated ahead while actor_train trains.

``RolloutSource.next(roles, step)`` returns the groups a step trains on, each sample with its reward and
the policy version (the training step whose weights the engine held) that generated it. Two duties live
here so that the pipeline's step stays one screen:

* **DAPO dynamic-sampling refills.** With ``algorithm.dynamic_sampling`` a group whose rewards are all
  equal has zero advantage and is dropped. Instead of training on a short batch, the source draws more
  prompts and generates again, up to ``algorithm.dynamic_sampling_max_rounds`` extra rounds, until
  ``rollout.batch_size / group_size`` groups with a reward spread are in hand; surplus groups of the
  last round are discarded (as DAPO does). Short of groups after the last round, the batch is made up
  with equal-reward groups, which the loss's own filter drops (the step trains on fewer samples). Logged: ``dapo/rounds``, ``dapo/filtered_groups``,
  ``dapo/kept_groups``, ``dapo/missing_groups`` and the accuracy over every generated sample.
* **Off-policy by k steps** (``rollout.async_steps``, see ``docs/async.md``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from reroll.algorithms.shaping import equal_reward_mask
from reroll.config.schema import RunConfig
from reroll.data.datasets import DomainSampler, PromptSampler
from reroll.data.types import Completion, RewardItem, Rollout, Sample
from reroll.pipelines.common import sampling, step_seed
from reroll.pipelines.run import Roles
from reroll.rewards import routing
from reroll.rewards.base import RewardResult

log = logging.getLogger(__name__)


@dataclass
class Scored:
    """Samples with their rewards, grouped by prompt (``rollouts[i].group`` numbers the groups from 0),
    and the policy version that generated each."""

    rollouts: list[Rollout] = field(default_factory=list)
    results: list[RewardResult] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rollouts)

    @property
    def prompts(self) -> list[Sample]:
        """One sample per group, in group order."""
        first: dict[int, Sample] = {}
        for r in self.rollouts:
            first.setdefault(r.group, r.sample)
        return [first[g] for g in sorted(first)]

    def groups(self) -> list[Scored]:
        """Each group on its own (in order)."""
        out: dict[int, Scored] = {}
        for r, res, v in zip(self.rollouts, self.results, self.versions):
            part = out.setdefault(r.group, Scored())
            part.rollouts.append(r)
            part.results.append(res)
            part.versions.append(v)
        return [out[g] for g in sorted(out)]

    @staticmethod
    def join(parts: list[Scored]) -> Scored:
        """Groups concatenated, renumbered 0..G-1 in order."""
        out = Scored()
        for g, part in enumerate(parts):
            out.rollouts += [Rollout(r.sample, g, r.completion) for r in part.rollouts]
            out.results += part.results
            out.versions += part.versions
        return out


def round_seed(cfg: RunConfig, step: int, round_: int) -> int:
    """The sampling seed of a step's ``round_``-th generation round (0: the step's own seed)."""
    return step_seed(cfg, step) + round_ * 1_000_000_007


class RolloutSource:
    """The generate and reward phases of an RLVR step (``next``), with their own checkpointed state."""

    def __init__(self, cfg: RunConfig, sampler: PromptSampler | DomainSampler) -> None:
        self.cfg = cfg
        self.sampler = sampler
        self.engine_version = 0  # the training step whose weights actor_infer holds (0: model.path)
        self.engine_metrics: dict[str, float] = {}

    def next(self, roles: Roles, step: int) -> tuple[Scored, dict[str, float]]:
        """The scored groups ``step`` trains on and the metrics of making them."""
        first = self._round(roles, step, 0)
        if not self.cfg.algorithm.dynamic_sampling:
            return first, self._generated_metrics([first])
        return self._refilled(roles, step, first)

    def _round(self, roles: Roles, step: int, round_: int) -> Scored:
        """One generation round: a batch of prompts from the sampler, generated and scored now."""
        prompts = self.sampler.next_batch()
        params = sampling(self.cfg, n=self.cfg.rollout.group_size, seed=round_seed(self.cfg, step, round_))
        with roles.phase("generate", "actor_infer"):
            groups = roles.rollout.generate([s.prompt for s in prompts], params)
            self.engine_metrics = roles.rollout.metrics()
        return self._score(roles, prompts, groups, [self.engine_version] * len(prompts))

    def _score(
        self, roles: Roles, prompts: list[Sample], groups: list[list[Completion]], versions: list[int]
    ) -> Scored:
        rollouts = [Rollout(s, g, c) for g, (s, comps) in enumerate(zip(prompts, groups)) for c in comps]
        assert roles.reward is not None
        with roles.phase("reward"):
            results = roles.reward.score([RewardItem.answering(r.sample, r.completion) for r in rollouts])
        per_sample = [v for v, comps in zip(versions, groups) for _ in comps]
        return Scored(rollouts, results, per_sample)

    def _refilled(self, roles: Roles, step: int, first: Scored) -> tuple[Scored, dict[str, float]]:
        """DAPO dynamic sampling: groups with a reward spread, refilled by extra rounds up to the batch."""
        want, max_rounds = self.cfg.prompts_per_step, self.cfg.algorithm.dynamic_sampling_max_rounds
        rounds, kept, flat = [first], [], []
        while True:
            spread, equal = _split_by_spread(rounds[-1])
            kept, flat = kept + spread, flat + equal
            if len(kept) >= want or len(rounds) > max_rounds:
                break
            rounds.append(self._round(roles, step, len(rounds)))
        missing = max(0, want - len(kept))
        if missing:
            log.warning(
                "step %d: dynamic sampling found %d of %d groups with a reward spread in %d generation "
                "rounds; the batch is made up with %d equal-reward groups, which the loss drops (raise "
                "algorithm.dynamic_sampling_max_rounds to refill more)",
                step, len(kept), want, len(rounds), missing,
            )  # fmt: skip
        metrics = self._generated_metrics(rounds) | {
            "dapo/rounds": float(len(rounds)),
            "dapo/filtered_groups": float(len(flat)),
            "dapo/kept_groups": float(min(len(kept), want)),
            "dapo/missing_groups": float(missing),
        }
        return Scored.join(kept[:want] + flat[:missing]), metrics

    def _generated_metrics(self, rounds: list[Scored]) -> dict[str, float]:
        """Reward and accuracy over every sample generated this step (dropped groups included)."""
        if not self.cfg.algorithm.dynamic_sampling:
            return dict(self.engine_metrics)
        results = [r for part in rounds for r in part.results]
        n = max(1, len(results))
        return self.engine_metrics | {
            "dapo/generated_accuracy": sum(routing.is_correct(r) for r in results) / n,
            "dapo/generated_reward_mean": sum(r.score for r in results) / n,
        }

    def push_weights(self, roles: Roles, step: int) -> float:
        """actor_train's weights after ``step`` into actor_infer: the bytes sent."""
        sent = roles.sync_weights()
        self.engine_version = step
        return sent

    def state(self) -> dict[str, Any]:
        return {"engine_version": self.engine_version}

    def restore(self, state: dict[str, Any]) -> None:
        """Back to a saved ``state`` (a resumed engine gets the checkpoint's weights at the first sync)."""
        self.engine_version = int(state["engine_version"])


def _split_by_spread(scored: Scored) -> tuple[list[Scored], list[Scored]]:
    """The groups whose raw rewards are not all equal (DAPO keeps these), and the others, in order."""
    if not scored.rollouts:
        return [], []
    rewards = torch.tensor([r.score for r in scored.results], dtype=torch.float32)
    ids = torch.tensor([r.group for r in scored.rollouts], dtype=torch.long)
    spread = {int(g) for g in ids[equal_reward_mask(rewards, ids)].unique()}
    ordered = sorted({r.group for r in scored.rollouts})
    groups = list(zip(ordered, scored.groups()))
    return [grp for g, grp in groups if g in spread], [grp for g, grp in groups if g not in spread]
