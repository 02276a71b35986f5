"""Reward functions that fail, for test_run_failures, in a module of their own so that a reward process
imports only this."""

from __future__ import annotations

from reroll.rewards.base import RewardResult


def always_type_error(prompt, response, sample):
    return RewardResult(len(response) + "1")  # TypeError: unsupported operand type(s) for +: 'int' and 'str'


def type_error_unless_right(prompt, response, sample):
    """Raises on every response but the right one: `reroll validate` (which gives it the row's own answer)
    passes it, and a run finds it on the model's responses."""
    if response == sample["answer"]:
        return RewardResult(1.0)
    return RewardResult(len(response) + "1")


def nan_reward(prompt, response, sample):
    """NaN for every response but the right one (which `reroll validate` gives it)."""
    return RewardResult(1.0 if response == sample["answer"] else float("nan"))


def with_threshold(prompt, response, sample, *, threshold=0.5):
    return RewardResult(float(len(response) > threshold))


_SAID: list[bool] = []


def fails_on_odd_lengths(prompt, response, sample):
    """Raises on responses of odd length (about half a random model's), and prints one line from its
    process (which Ray shows with the worker's prefix)."""
    if not _SAID:
        print("reward process ready", flush=True)
        _SAID.append(True)
    if len(response) % 2:
        raise ValueError(f"odd length {len(response)}")
    return RewardResult(float(response == sample["answer"]))
