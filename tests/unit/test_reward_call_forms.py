"""A reward takes (prompt, response, row) by position, or the row's fields as keywords as TRL's do; the
form is read off its parameter names, and `reroll validate` binds either (reroll.rewards.calling)."""

from __future__ import annotations

import time

import pytest

from reroll.config.reward import RewardConfig
from reroll.rewards import called
from reroll.rewards.calling import bind_problem, call_form
from reroll.rewards.isolation import ProcessPool
from reroll.rewards.routing import RewardRouter

ROW = {"question": "123", "answer": "321", "level": 2}


def positional(prompt, response, row): ...
def positional_sample(prompt, response, sample, *, threshold=0.5): ...
def positional_any_names(p, r, x): ...
def trl(response, answer, **kwargs): ...
def named(prompt, response, answer): ...
def response_then_row(response, answer, row): ...
def completion_only(completion): ...
def misspelled(response, anwser): ...
def with_option(response, answer, *, bonus=0.0): ...


@pytest.mark.parametrize(
    ("fn", "form"),
    [
        (positional, "positional"),
        (positional_sample, "positional"),
        (positional_any_names, "positional"),  # names no response: by position, as before
        (trl, "keywords"),
        (named, "keywords"),  # a third parameter named after a field is that field, not the row
        (response_then_row, "keywords"),
        (completion_only, "keywords"),
    ],
)
def test_the_call_form_is_read_off_the_parameter_names(fn, form):
    assert call_form(fn) == form


def test_a_keyword_reward_gets_the_fields_it_names_or_all_with_kwargs():
    seen = {}

    def trl_style(response, answer, **kwargs):
        seen.update(kwargs, response=response, answer=answer)
        return float(response == answer)

    assert called(trl_style)("reverse 123", "321", ROW) == 1.0
    assert seen == {
        "response": "321",
        "answer": "321",
        "question": "123",
        "level": 2,
        "prompt": "reverse 123",
    }

    def two(response, row, *, bonus):
        return (response, row, bonus)

    # named: only what it names; `row` is the whole row; config args come last and win
    assert called(two, {"bonus": 0.5})("p", "r", ROW) == ("r", ROW, 0.5)
    assert called(with_option_fn, {"answer": "x"})("p", "x", ROW) == 1.0


def with_option_fn(response, answer, *, bonus=0.0):
    return float(response == answer) + bonus


def test_validate_binds_either_form_against_the_rows_fields_and_args():
    fields = set(ROW)
    assert bind_problem(positional, "m:positional", {}, "reward", fields) is None
    assert bind_problem(trl, "m:trl", {}, "reward", fields) is None
    assert bind_problem(with_option, "m:with_option", {"bonus": 1.0}, "reward", fields) is None
    key, message = bind_problem(misspelled, "m:misspelled", {}, "reward", fields)
    assert key == "reward.fn"
    assert "the rows have no field 'anwser' (did you mean 'answer'?)" in message
    assert "['answer', 'level', 'question']" in message
    key, message = bind_problem(with_option, "m:with_option", {"bonis": 1.0}, "reward", fields)
    assert key == "reward.args" and "'bonis' (did you mean 'bonus'?)" in message
    assert bind_problem(misspelled, "m:misspelled", {"anwser": "1"}, "reward", fields) is None  # args give it
    assert bind_problem(misspelled, "m:misspelled", {}, "reward", None) is None  # fields unknown: no claim


def test_a_keyword_reward_runs_in_a_thread_and_in_a_child_process():
    fn = "isolated_rewards:trl_style"  # tests/unit/isolated_rewards.py, a light module to import in a child
    thread = RewardRouter(RewardConfig(fn=fn))
    assert thread.score("reverse 123", "321", ROW, "default").details == {
        "fields": 3
    }  # question, level, prompt
    pool = ProcessPool(1, preload=[(fn, {})])
    try:
        isolated = RewardRouter(RewardConfig(fn=fn), pool)
        result = isolated.score("reverse 123", "321", ROW, "default", deadline=time.monotonic() + 30)
        assert (result.score, dict(result.details)) == (1.0, {"fields": 3})
    finally:
        pool.close()
