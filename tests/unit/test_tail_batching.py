"""Tail batching with fake roles: long groups set aside, finished from their tokens in a tail step."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from reroll.config.schema import RunConfig
from reroll.data.datasets import PromptSampler
from reroll.data.types import Completion, Sample
from reroll.pipelines.rollout_source import RolloutSource
from reroll.rewards.base import RewardResult


class LengthRollout:
    """A prompt '2,9' asks for responses of 2 and 9 tokens; a continuation (token ids: the target
    length, then the tokens so far) writes the rest. Records each call's max_new_tokens."""

    def __init__(self) -> None:
        self.budgets: list[int] = []

    def generate(self, prompts, params, phase="generate"):
        self.budgets.append(params.max_new_tokens)
        out = []
        for p in prompts:
            rows = [[int(t)] for t in p.split(",")] if isinstance(p, str) else [p] * params.n
            out.append([self._complete(row, params.max_new_tokens) for row in rows])
        return out

    @staticmethod
    def _complete(row, budget):
        target, done = row[0], len(row) - 1
        n = min(target - done, budget)
        finish = "stop" if done + n == target else "length"
        return Completion(row, [7] * n, "x" * n, [-0.5] * n, finish)

    def metrics(self, now=False):
        return {}


class LengthReward:
    def score(self, items, phase="reward"):
        return [RewardResult(len(it.response) / 10) for it in items]


class FakeRoles:
    def __init__(self) -> None:
        self.actor_infer, self.reward, self.phases = LengthRollout(), LengthReward(), []
        self.learned_reward = None

    @contextmanager
    def phase(self, name, *uses):
        self.phases.append(name)
        yield


def source(prompts: list[str], share: float) -> RolloutSource:
    cfg = RunConfig.model_validate(
        {
            "pipeline": "rlvr",
            "model": {"path": "org/model"},
            "data": {"train_files": ["x.jsonl"]},
            "rollout": {"batch_size": 8, "group_size": 2, "max_new_tokens": 10, "tail_threshold": 4,
                        "tail_share": share},
        }
    )  # fmt: skip
    rows = [Sample(f"u{i}", p, {}) for i, p in enumerate(prompts)]
    return RolloutSource(cfg, PromptSampler(rows, 4, shuffle=False))


def lengths(scored):
    return [len(r.completion.response_ids) for r in scored.rollouts]


def test_long_groups_wait_for_a_tail_step_and_are_finished_from_their_tokens():
    roles = FakeRoles()
    src = source(["2,3", "2,9", "5,1", "2,2", "9,9", "1,1", "7,1", "1,2", "1,1", "1,1", "1,1", "1,1"], 0.5)
    scored, m = src.next(roles, step=1)
    assert lengths(scored) == [2, 3, 2, 2]  # groups 0 and 3; '2,9' and '5,1' set aside
    assert (m["tail/step"], m["tail/deferred_groups"], m["tail/pending_groups"]) == (0, 2, 2)
    assert m["tail/deferred_share"] == 0.5 and m["rollout/length_max"] == 3
    src.engine_version = 1
    scored, m = src.next(roles, step=2)
    assert lengths(scored) == [1, 1, 1, 2] and m["tail/pending_groups"] == 4
    src.engine_version = 2
    scored, m = src.next(roles, step=3)  # a tail step: the four groups set aside, finished
    assert m["tail/step"] == 1 and m["tail/pending_groups"] == 0
    assert lengths(scored) == [2, 9, 5, 1, 9, 9, 7, 1]
    assert all(r.completion.finish_reason == "stop" for r in scored.rollouts)
    assert [r.sample.prompt for r in scored.rollouts[::2]] == ["2,9", "5,1", "9,9", "7,1"]
    nine = scored.rollouts[1].completion  # 4 tokens at step 1's weights (version 0), 5 at version 2
    assert nine.prompt_ids == [9] and nine.text == "x" * 9 and nine.logprobs == [-0.5] * 9
    assert scored.versions[1] == [0] * 4 + [2] * 5 and scored.versions[0] == [0, 0]
    assert scored.results[1].score == pytest.approx(0.9)  # scored once finished
    assert m["staleness/max"] == 2  # trainer at step 2: the first tokens of step 1's groups
    assert src.sampler.state()["index"] == 8  # a tail step draws no prompts
    assert roles.actor_infer.budgets == [4, 4, 6]  # ordinary steps stop at the threshold; the tail runs on
    assert "generate_tail" in roles.phases


def test_past_tail_share_a_step_finishes_its_own_long_groups():
    roles = FakeRoles()
    src = source(["2,9", "5,1", "1,1", "2,2"], 0.25)
    scored, m = src.next(roles, step=1)
    assert (m["tail/deferred_groups"], m["tail/finished_in_step"]) == (1, 1)
    assert lengths(scored) == [5, 1, 1, 1, 2, 2]  # '2,9' set aside, '5,1' finished here


def test_pending_groups_survive_a_checkpoint(tmp_path):
    import torch

    src = source(["2,9", "5,1", "1,1", "2,2"], 0.5)
    src.next(FakeRoles(), step=1)
    torch.save(src.queue_state(), tmp_path / "rollout_queue.pt")
    again = source(["2,9", "5,1", "1,1", "2,2"], 0.5)
    again.restore(src.state(), tmp_path)
    assert [p.completions for p in again.tail.pending] == [p.completions for p in src.tail.pending]
    assert [p.versions for p in again.tail.pending] == [p.versions for p in src.tail.pending]


@pytest.mark.parametrize(
    "rollout, message",
    [
        ({"tail_threshold": 64}, "must be below rollout.max_new_tokens (64)"),
        ({"tail_threshold": 8, "async_steps": 1}, "tail batching does not run with rollout.async_steps"),
        ({"tail_share": 0.5}, "rollout.tail_share"),
    ],
)
def test_tail_configs_that_cannot_run_are_refused(rollout, message):
    cfg = RunConfig.model_validate(
        {
            "pipeline": "rlvr",
            "model": {"path": "org/model"},
            "data": {"train_files": ["x"]},
            "rollout": rollout,
        }
    )
    assert any(message in str(p) for p in cfg.check())


def test_a_snapshot_holds_the_pending_groups_as_they_were_and_rewinds_to_them():
    """``Pipeline.snapshot`` (taken before every step, for a retry after a worker died) copies the
    groups set aside: the queue's records now hand over their own lists (``field_values``, not
    ``dataclasses.asdict``'s copies), so the snapshot alone must keep them from what the step does next;
    ``rewind`` brings them back through ``restore``."""
    import copy

    from reroll.pipelines.pipeline import Checkpointed, Pipeline

    class Tail(Pipeline):
        name = "tail-test"

        def __init__(self, src: RolloutSource) -> None:
            self.src = src

        def checkpointed(self) -> Checkpointed:
            return Checkpointed({"source": self.src.state()}, {"rollout_queue.pt": self.src.queue_state()})

        def restore(self, saved, directory):
            self.src.restore(saved["source"], directory)

    src = source(["2,9", "5,1", "1,1", "2,2"], 0.5)
    src.next(FakeRoles(), step=1)
    pipeline = Tail(src)
    before = copy.deepcopy([(p.completions, p.versions) for p in src.tail.pending])
    saved = pipeline.snapshot()
    for p in src.tail.pending:  # the live lists change after the snapshot; the snapshot must not
        p.completions[0].response_ids.append(7)
        p.versions[0].append(99)
    assert [(p.completions, p.versions) for p in src.tail.pending] != before
    pipeline.rewind(saved)
    assert [(p.completions, p.versions) for p in src.tail.pending] == before
