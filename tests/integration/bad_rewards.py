"""Reward functions that fail, for test_run_failures, in a module of their own so that a reward process
imports only this."""

from __future__ import annotations

from reroll.rewards.base import RewardResult


def always_type_error(prompt, response, sample):
    return RewardResult(len(response) + "1")  # TypeError: unsupported operand type(s) for +: 'int' and 'str'


def nan_reward(prompt, response, sample):
    return RewardResult(float("nan"))


def with_threshold(prompt, response, sample, *, threshold=0.5):
    return RewardResult(float(len(response) > threshold))
