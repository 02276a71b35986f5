"""RolloutSource with fake roles: DAPO refills (rounds, filtered groups, data position)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from reroll.config.schema import RunConfig
from reroll.data.datasets import PromptSampler
from reroll.data.types import Completion, Sample
from reroll.pipelines.async_rollout import RolloutSource, round_seed
from reroll.rewards.base import RewardResult


class FakeRollout:
    """Each prompt's completions are its row's ``scores`` as text, one per sample; records each call's seed."""

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    def generate(self, prompts, params, phase="generate"):
        self.seeds.append(params.seed)
        return [[Completion([1], [2], f"{s}", [0.0], "stop") for s in p.split(",")] for p in prompts]

    def metrics(self):
        return {"engine/requests": 1.0}


class FakeReward:
    def score(self, items, phase="reward"):
        return [RewardResult(float(it.response)) for it in items]


class FakeRoles:
    def __init__(self) -> None:
        self.rollout, self.reward, self.phases = FakeRollout(), FakeReward(), []

    @contextmanager
    def phase(self, name, *uses):
        self.phases.append(name)
        yield


def make_cfg(**algorithm) -> RunConfig:
    return RunConfig.model_validate(
        {
            "pipeline": "rlvr",
            "model": {"path": "org/model"},
            "data": {"train_files": ["x.jsonl"]},
            "rollout": {"batch_size": 8, "group_size": 2},
            "algorithm": algorithm,
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
    assert roles.rollout.seeds == [round_seed(cfg, 5, r) for r in range(3)]
    assert len(set(roles.rollout.seeds)) == 3
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


def test_no_refill_without_dynamic_sampling():
    cfg = make_cfg()
    roles, data = FakeRoles(), sampler(["0,0", "1,1", "1,0", "0,0"], 4)
    scored, metrics = RolloutSource(cfg, data).next(roles, step=1)
    assert len(scored) == 8 and not any(k.startswith("dapo/") for k in metrics)
    assert roles.rollout.seeds == [round_seed(cfg, 1, 0)]


def test_max_rounds_without_dynamic_sampling_is_an_error():
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds is set"):
        make_cfg(dynamic_sampling_max_rounds=2)
