"""A reward that fails on too many samples stops the run with its first error; a few failures do not."""

import pytest

from reroll.config.reward import RewardConfig
from reroll.data.types import RewardItem
from reroll.errors import RewardFailure, UserError
from reroll.rewards.base import RewardResult
from reroll.rewards.routing import check_failures
from reroll.roles.reward import ErrorLog, RewardWorker


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
    message = results[1].details["reward_error_message"]
    assert message.startswith(
        f"reward.fn '{__name__}:_raise_on_odd' raised KeyError: \"no such field: 'solution'\" (at "
    )
    assert message.endswith(
        "test_reward_failures.py, line 19, in _raise_on_odd)"
    )  # where the user's code raised it
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


def test_each_kind_of_failure_is_said_once_with_its_traceback_in_a_file(caplog, tmp_path):
    worker, log = _worker(f"{__name__}:_raise_on_odd"), ErrorLog(timeout_s=30)
    with caplog.at_level("WARNING", logger="reroll.roles"):
        first = log.note(worker.score(_items(10)), "evaluate")  # before the run directory is written
        assert caplog.records == [] and len(log.pending) == 1
        log.write_to(tmp_path / "reward_errors.txt")
        log.note(worker.score(_items(10)), "reward")  # the same bug at the next step: said already
        log.note([RewardResult(0.0, {"reward_timeout": 1, "reward_error": 0})], "reward")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # the worker logs nothing per call; the group one line per kind of failure
    assert lines[0].startswith("reward: 5 of 10 samples failed during evaluate: reward.fn ")
    assert "raised KeyError" in lines[0] and f"the traceback: {tmp_path / 'reward_errors.txt'}" in lines[0]
    assert "a call passed reward.sample_timeout_s=30s" in lines[1]
    text = (tmp_path / "reward_errors.txt").read_text()
    assert text.count("Traceback (most recent call last)") == 1 and "in _raise_on_odd" in text
    assert all("reward_error_traceback" not in r.details for r in first)  # kept out of the metrics' details
