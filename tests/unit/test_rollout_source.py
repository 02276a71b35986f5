"""RolloutSource with fake roles: DAPO refills (rounds, filtered groups, data position), async queue,
over-sampling (groups kept in finishing order) and partial-rollout segments (versions per token)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from reroll.config.schema import RunConfig
from reroll.data.datasets import PromptSampler
from reroll.data.types import Completion, Rollout, Sample
from reroll.pipelines.rollout_source import RolloutSource, Scored, _Queued, round_seed, staleness_metrics
from reroll.rewards.base import RewardResult


class FakeRollout:
    """Each prompt's completions are its row's ``scores`` as text, one per sample; records each call's seed."""

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    def generate(self, prompts, params, phase="generate"):
        return self.collect(self.submit(prompts, params))

    def submit(self, prompts, params, stale_ok=False):
        self.seeds.append(params.seed)
        return [prompts]

    def collect(self, refs, phase="generate"):
        completion = lambda s: Completion([1], [2], s, [0.0], "stop")  # noqa: E731
        return [[completion(s) for s in p.split(",")] for prompts in refs for p in prompts]

    def wait_loaded(self, refs):
        pass

    def metrics(self, now=False):
        return {"engine/requests": 1.0}


class FakeReward:
    def score(self, items, phase="reward"):
        return [RewardResult(float(it.response)) for it in items]


class FakeRewardModel:
    """The served reward model (RLHF): each response's number, twice, as its score; nothing truncated."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, prompts, responses, phase="reward"):
        self.calls += 1
        return torch.tensor([2.0 * float(r) for r in responses]), torch.zeros(
            len(responses), dtype=torch.bool
        )


class FakeRoles:
    def __init__(self) -> None:
        self.actor_infer, self.reward, self.phases = FakeRollout(), FakeReward(), []
        self.learned_reward: FakeRewardModel | None = None

    @contextmanager
    def phase(self, name, *uses):
        self.phases.append(name)
        yield


def make_cfg(rollout=None, reward=None, **algorithm) -> RunConfig:
    return RunConfig.model_validate(
        {
            "pipeline": "rlvr",
            "model": {"path": "org/model"},
            "data": {"train_files": ["x.jsonl"]},
            "rollout": {"batch_size": 8, "group_size": 2, **(rollout or {})},
            "algorithm": algorithm,
            **({"reward": reward} if reward else {}),
        }
    )


def sampler(prompts: list[str], batch: int) -> PromptSampler:
    """Prompts are the scores of their group's samples, e.g. '1,0' (a spread) or '0,0' (none)."""
    rows = [Sample(f"u{i}", p, {"answer": ""}) for i, p in enumerate(prompts)]
    return PromptSampler(rows, batch, shuffle=False)


def test_refill_rounds_until_the_batch_is_full():
    # 4 groups per step; round 0 has 2 with a spread, round 1 has 1, round 2 has 3 (one surplus)
    rounds = [["1,0", "0,0", "1,1", "0,1"], ["0,0", "1,1", "1,0", "0,0"], ["1,0", "0,1", "1,0", "0,0"]]
    prompts = [p for r in rounds for p in r]
    cfg = make_cfg(dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    roles, data = FakeRoles(), sampler(prompts, 4)
    scored, metrics = RolloutSource(cfg, data).next(roles, step=5)

    assert metrics["dapo/rounds"] == 3
    assert metrics["dapo/filtered_groups"] == 2 + 3 + 1  # equal-reward groups of the three rounds
    assert metrics["dapo/kept_groups"] == 4 and metrics["dapo/missing_groups"] == 0
    assert metrics["dapo/generated_accuracy"] == pytest.approx(10 / 24)  # ones: 4 + 3 + 3 of 24 samples
    assert [r.sample.prompt for r in scored.rollouts[::2]] == ["1,0", "0,1", "1,0", "1,0"]
    assert [r.group for r in scored.rollouts] == [0, 0, 1, 1, 2, 2, 3, 3]  # renumbered
    assert len(scored) == cfg.rollout.batch_size
    # each round drew a fresh batch of prompts (the data position moved 3 batches) with its own seed
    assert data.state() == {"epoch": 0, "index": 12}
    assert roles.actor_infer.seeds == [round_seed(cfg, 5, r) for r in range(3)]
    assert len(set(roles.actor_infer.seeds)) == 3
    assert roles.phases == ["generate", "reward"] * 3


def test_refill_stops_after_max_rounds_and_trains_on_what_it_has():
    prompts = ["1,0", "0,0", "0,0", "0,0"] * 3
    cfg = make_cfg(dynamic_sampling=True, dynamic_sampling_max_rounds=1)
    scored, metrics = RolloutSource(cfg, sampler(prompts, 4)).next(FakeRoles(), step=1)
    assert metrics["dapo/rounds"] == 2  # the first and one extra
    assert metrics["dapo/kept_groups"] == 2 and metrics["dapo/missing_groups"] == 2
    # made up to the batch with the first equal-reward groups, which the loss's filter drops
    assert [r.sample.prompt for r in scored.rollouts[::2]] == ["1,0", "1,0", "0,0", "0,0"]
    assert len(scored) == 8


class OnesReward:
    """A rule reward that scores every response 1: no group has a spread by the rule."""

    def score(self, items, phase="reward"):
        return [RewardResult(1.0) for _ in items]


def test_rlhf_refills_on_the_reward_models_score_not_the_rule():
    # the rule gives every sample 1; the reward model scores each response's number: '3,3' and '5,5' have
    # no spread by it, '1,0' and '2,4' do. DAPO must keep the groups the reward model separates.
    prompts = ["3,3", "1,0", "5,5", "2,4"] * 2
    cfg = make_cfg(
        reward={"fn": "exact_match", "model": {"path": "rm", "rule_weight": 0.5}},
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=1,
    )
    roles = FakeRoles()
    roles.reward, roles.learned_reward = OnesReward(), FakeRewardModel()
    scored, metrics = RolloutSource(cfg, sampler(prompts, 4)).next(roles, step=1)
    assert metrics["dapo/rounds"] == 2 and metrics["dapo/kept_groups"] == 4
    assert [r.sample.prompt for r in scored.rollouts[::2]] == ["1,0", "2,4", "1,0", "2,4"]
    assert scored.model_scores == [2.0, 0.0, 4.0, 8.0] * 2  # carried with their groups
    assert scored.training_rewards(cfg).tolist() == [2.5, 0.5, 4.5, 8.5] * 2  # weight 1, rule_weight 0.5
    assert roles.learned_reward.calls == 2  # once per generation round, in the reward phase
    assert roles.phases == ["generate", "reward"] * 2
    # the same rounds without a reward model: every group has equal rule rewards, none is kept
    _, rule_only = RolloutSource(
        make_cfg(dynamic_sampling=True, dynamic_sampling_max_rounds=1), sampler(prompts, 4)
    ).next(roles_with(OnesReward()), step=1)
    assert rule_only["dapo/kept_groups"] == 0


def roles_with(reward) -> FakeRoles:
    roles = FakeRoles()
    roles.reward = reward
    return roles


def test_no_refill_without_dynamic_sampling():
    cfg = make_cfg()
    roles, data = FakeRoles(), sampler(["0,0", "1,1", "1,0", "0,0"], 4)
    scored, metrics = RolloutSource(cfg, data).next(roles, step=1)
    assert len(scored) == 8 and not any(k.startswith("dapo/") for k in metrics)
    assert roles.actor_infer.seeds == [round_seed(cfg, 1, 0)]


def test_max_rounds_without_dynamic_sampling_is_an_error():
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds is set"):
        make_cfg(dynamic_sampling_max_rounds=2)


def test_async_submits_ahead_and_stamps_the_engine_version():
    cfg = make_cfg({"async_steps": 2})
    assert cfg.algorithm.rollout_is == "token"  # importance sampling on by default when async
    roles, source = FakeRoles(), RolloutSource(cfg, sampler(["1,0"] * 40, 4))
    _, metrics = source.next(roles, step=1)
    assert sorted(source.queue) == [2, 3]  # steps 2 and 3 submitted ahead, in order
    assert roles.actor_infer.seeds == [round_seed(cfg, s, 0) for s in (1, 2, 3)]
    assert metrics["staleness/mean"] == 0
    source.engine_version = 1  # push_weights after step 1 (fake roles: only the version)
    _, metrics = source.next(roles, step=2)  # generated before step 1 trained: one step stale
    assert metrics["staleness/max"] == 1 and metrics["staleness/off_policy_tokens"] == 1
    assert source.queue[4].version == 1  # submitted at step 2, behind the weights of step 1


def test_groups_older_than_max_staleness_are_generated_again():
    cfg = make_cfg({"async_steps": 1, "max_staleness": 1})
    roles, source = FakeRoles(), RolloutSource(cfg, sampler(["1,0", "0,1"] * 20, 4))
    source.next(roles, step=1)  # queues step 2 with version 0
    # as if a run resumed with older samples queued: step 7's, of version 0, are 6 - 0 > 1 steps stale
    source.queue[7], source.engine_version = source.queue.pop(2), 5
    _, metrics = source.next(roles, step=7)
    assert metrics["staleness/regenerated_groups"] == 4
    assert metrics["staleness/max"] == 1  # regenerated by the engine's weights (step 5) at step 7


def test_staleness_is_measured_per_token():
    def rollout(n_tokens: int) -> Rollout:
        return Rollout(Sample("u", "p", {}), 0, Completion([1], [2] * n_tokens, "", [0.0] * n_tokens, "stop"))

    scored = Scored([rollout(1), rollout(3)], [RewardResult(0.0)] * 2, versions=[[4], [2, 2, 2]])
    m = staleness_metrics(scored, trainer_version=4)
    # tokens: 1 at staleness 0, 3 at staleness 2 -> mean (0 + 6) / 4, off-policy 3 / 4
    assert m == {
        "staleness/mean": 1.5,
        "staleness/max": 2.0,
        "staleness/off_policy_tokens": 0.75,
        "staleness/mixed_samples": 0.0,
    }
    # a partial rollout: the first token from policy 3, the second from policy 4 (the trainer's)
    mixed = staleness_metrics(Scored([rollout(2)], [RewardResult(0.0)], [[3, 4]]), trainer_version=4)
    assert mixed == {
        "staleness/mean": 0.5,
        "staleness/max": 1.0,
        "staleness/off_policy_tokens": 0.5,
        "staleness/mixed_samples": 1.0,
    }


class StreamingRollout(FakeRollout):
    """Groups finish last prompt first, a response of ``i + 1`` tokens for prompt ``i``; after
    ``interrupt`` the rest come back cut (``abort``, no tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def stream(self, prompts, params):
        for i in reversed(range(len(prompts))):
            reason = "abort" if self.interrupted else "stop"
            n = 0 if self.interrupted else i + 1
            yield i, [Completion([1], [2] * n, s, [0.0] * n, reason) for s in prompts[i].split(",")]

    def interrupt(self):
        self.interrupted = True


class StreamingReward(FakeReward):
    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, items):
        self.submitted += 1
        return self.score(items)

    def collect(self, pending, phase="reward"):
        return [r for p in pending for r in p]


def test_oversampling_keeps_the_first_groups_to_finish_and_scores_each_as_it_comes():
    cfg = make_cfg({"oversample": 1.5})  # 4 groups a step: 6 prompts drawn
    roles, source = FakeRoles(), RolloutSource(cfg, sampler([f"{i},0" for i in range(12)], 4))
    roles.actor_infer, roles.reward = StreamingRollout(), StreamingReward()
    scored, metrics = source.next(roles, step=1)
    assert [r.sample.prompt for r in scored.rollouts[::2]] == ["5,0", "4,0", "3,0", "2,0"]  # finish order
    assert [r.score for r in scored.results[::2]] == [5.0, 4.0, 3.0, 2.0]
    assert roles.reward.submitted == 4  # one call per group, as it finished
    assert roles.actor_infer.interrupted
    assert metrics["rollout/oversample_dropped_groups"] == 2
    assert metrics["rollout/oversample_dropped_unfinished"] == 1.0
    assert metrics["rollout/oversample_kept_length"] == (6 + 5 + 4 + 3) / 4
    assert metrics["rollout/oversample_dropped_length"] == 0
    assert source.sampler.index == 6 and source.sampler.batch_size == 4  # the draw consumed 6 prompts


def test_oversampled_rlhf_rounds_carry_the_reward_models_scores():
    cfg = make_cfg({"oversample": 1.5}, reward={"fn": "exact_match", "model": {"path": "rm"}})
    roles, source = FakeRoles(), RolloutSource(cfg, sampler([f"{i},0" for i in range(12)], 4))
    roles.actor_infer, roles.reward, roles.learned_reward = (
        StreamingRollout(),
        StreamingReward(),
        FakeRewardModel(),
    )
    scored, _ = source.next(roles, step=1)
    assert scored.model_scores == [10.0, 0.0, 8.0, 0.0, 6.0, 0.0, 4.0, 0.0]  # the kept groups, in order
    assert scored.training_rewards(cfg).tolist() == scored.model_scores  # weight 1, rule_weight 0
    assert roles.learned_reward.calls == 1


class SegmentRollout(FakeRollout):
    def collect(self, refs, phase="generate"):
        return refs  # a segment's "references" are its groups here


def test_partial_rollout_segments_stamp_each_token_with_its_weights_version():
    """A response cut after 2 tokens of policy 1 and continued by policy 2 then 3; a finished one
    keeps policy 1 throughout."""
    roles, source = FakeRoles(), RolloutSource(make_cfg({"async_steps": 1}), sampler(["1,0"], 1))
    roles.actor_infer = SegmentRollout()
    c = lambda n, reason: Completion([1], list(range(n)), "", [0.0] * n, reason)  # noqa: E731
    first = [[c(2, "abort"), c(3, "stop")]]
    q = _Queued(3, [Sample("u", "p", {})], version=1, refs=first)
    q.resumed = [(2, [[c(4, "abort"), c(3, "stop")]]), (3, [[c(7, "stop"), c(3, "stop")]])]
    source._collect(roles, q)
    assert q.versions == [[[1, 1, 2, 2, 3, 3, 3], [1, 1, 1]]]
    [part] = q.parts()
    assert part.versions == q.versions[0] and part.completions[0].finish_reason == "stop"
