"""engine_judge through the reward role and a real `judge` role holding a tiny hf engine.

The tiny judge is random-init with a letters-only alphabet, so its replies hold no number: every
call takes the parse-failure path, which must give parse_error_score and be counted. (The
parse-success path is tested with a scripted engine in tests/unit/test_reward_judge.py.)
"""

from __future__ import annotations

import re

import pytest

from reroll.config.schema import RunConfig
from reroll.data.types import RewardItem
from reroll.errors import RoleError
from reroll.models.tiny import build_tiny_model
from reroll.rewards.routing import domain_metrics
from reroll.roles.reward import RewardGroup
from reroll.runtime.actors import start_ray

pytestmark = pytest.mark.integration


def judge_run(tmp_path, backend: str) -> RunConfig:
    judge = build_tiny_model(tmp_path / "judge", alphabet="abcdefghij :", hidden_size=64, num_heads=2)
    return RunConfig.model_validate(
        {
            "pipeline": "rlvr",
            "model": {"path": str(judge)},
            "data": {"train_files": [str(tmp_path / "rows.jsonl")]},
            "runtime": {"backend": backend, "call_timeout_s": 120},
            "roles": {"judge": {"torch_threads": 1}},
            "reward": {
                "domains": {
                    "chat": {"rewards": [{"fn": "engine_judge", "args": {"parse_error_score": -0.5}}]},
                    "math": {"rewards": [{"fn": "exact_match"}]},
                },
                "judge": {"model_path": str(judge), "max_new_tokens": 12},
                "sample_timeout_s": 60,
            },
        }
    )


def test_unparseable_judge_replies_get_the_defined_score_and_are_counted(tmp_path):
    cfg = judge_run(tmp_path, "local")
    group = RewardGroup(cfg)
    try:
        replies = group.judge.handles[0].generate.remote(["is 4 right?"]).value
        assert len(replies) == 1 and not re.search(r"\d", replies[0])  # the premise: no number to parse
        items = [
            RewardItem("q", "a", {}, "chat"),
            RewardItem("q", "4", {"answer": "4"}, "math"),
            RewardItem("q2", "b", {}, "chat"),
        ]
        results = group.score(items)
    finally:
        group.shutdown()
    assert [r.score for r in results] == [-0.5, 1.0, -0.5]
    m = domain_metrics([it.domain for it in items], results)
    assert (m["reward/chat/judge_parse_error"], m["reward/chat/mean"], m["reward/math/mean"]) == (
        1.0,
        -0.5,
        1.0,
    )
    assert m["reward/errors"] == 0.0  # a parse failure is the judge's answer, not a failed call


def test_a_dead_judge_is_a_role_error_naming_the_judge(tmp_path):
    import ray

    cfg = judge_run(tmp_path, "ray")
    start_ray(None)
    group = RewardGroup(cfg)
    try:
        assert group.score([RewardItem("q", "4", {"answer": "4"}, "math")])[0].score == 1.0
        ray.kill(group.judge.handles[0])
        with pytest.raises(RoleError, match=r"judge\[0\] failed during judge") as e:
            group.score([RewardItem("q", "a", {}, "chat")])
        assert (e.value.role, e.value.rank) == ("judge", 0)
        assert e.value.died  # so the run restarts it (Roles.restart("judge"), runtime.max_restarts)
        group.restart(judge=True)  # what Roles.restart("judge") does: judge ranks, then the reward workers
        [result] = group.score([RewardItem("q", "a", {}, "chat")])
        assert result.score == -0.5  # the new judge answers (its reply has no number: the parse-error score)
    finally:
        group.shutdown()
