"""A reward that fails on too many samples stops the run with its first error; a few failures do not."""

import pytest

from reroll.config.reward import RewardConfig
from reroll.data.types import RewardItem
from reroll.errors import RewardFailure, UserError
from reroll.rewards.base import RewardResult
from reroll.rewards.routing import check_failures
from reroll.roles.reward import RewardWorker


def _items(n: int) -> list[RewardItem]:
    return [RewardItem(f"{i}+0=", str(i), {"answer": str(i)}, "default") for i in range(n)]


def _raise_on_odd(prompt, response, row):
    if int(response) % 2:
        raise KeyError("no such field: 'solution'")
    return RewardResult(1.0, {"correct": 1})


def _worker(fn: str, **cfg) -> RewardWorker:
    return RewardWorker(0, RewardConfig(fn=fn, isolation="thread", threads=2, **cfg))


def test_a_raising_call_keeps_its_message_with_the_reward_key():
    worker = _worker(f"{__name__}:_raise_on_odd")
    results = worker.score(_items(4))
    assert [r.details.get("reward_error", 0) for r in results] == [0, 1, 0, 1]
    assert results[1].details["reward_error_message"] == (
        f"reward.fn '{__name__}:_raise_on_odd' raised KeyError: \"no such field: 'solution'\""
    )
    assert results[1].score == 0.0  # error_score


def test_more_than_the_share_stops_with_the_first_error():
    errors = [
        RewardResult(0.0, {"reward_error": 1, "reward_error_message": "reward.fn 'm:f' raised TypeError: x"})
    ]
    fine = [RewardResult(1.0, {"correct": 1})]
    check_failures(errors * 2 + fine * 2, RewardConfig(max_error_share=0.5), "reward")  # 2/4 is not more
    with pytest.raises(RewardFailure) as e:
        check_failures(errors * 3 + fine, RewardConfig(max_error_share=0.5), "reward")
    message = str(e.value)
    assert "failed on 3 of 4 samples during reward (more than reward.max_error_share=0.5)" in message
    assert "the first: reward.fn 'm:f' raised TypeError: x" in message
    assert isinstance(e.value, UserError)  # exit code 2
    assert "at step 7" in str(e.value.at_step(7))


def test_all_failed_stops_even_at_share_one_and_timeouts_count_apart():
    error = RewardResult(
        0.0, {"reward_error": 1, "reward_error_message": "reward.fn 'm:f' raised ValueError: v"}
    )
    timeout = RewardResult(0.0, {"reward_timeout": 1})
    fine = RewardResult(1.0, {})
    with pytest.raises(RewardFailure, match="every sample failed: 4 raised, 0 timed out"):
        check_failures([error] * 4, RewardConfig(max_error_share=1.0), "evaluate")
    check_failures([timeout] * 3 + [fine], RewardConfig(max_error_share=0.0), "reward")  # not in the share
    with pytest.raises(RewardFailure, match=r"every sample failed: 1 raised, 3 timed out.*ValueError: v"):
        check_failures([timeout] * 3 + [error], RewardConfig(), "reward")
    with pytest.raises(RewardFailure, match=r"passed reward\.sample_timeout_s=30s"):
        check_failures([timeout] * 2, RewardConfig(), "reward")
    check_failures([], RewardConfig(), "reward")


def test_the_worker_logs_one_line_per_call_not_per_sample(caplog):
    worker = _worker(f"{__name__}:_raise_on_odd")
    with caplog.at_level("WARNING", logger="reroll.roles.reward"):
        worker.score(_items(10))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "5 of 10 reward calls raised" in lines[1]
