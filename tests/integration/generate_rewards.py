"""A reward for test_generate that a random tiny model meets about half the time, so pass@k varies."""

from __future__ import annotations

from reroll.rewards.base import RewardResult


def odd_first_digit(prompt, response, sample):
    """1 when the response starts with an odd digit; the first character in details."""
    first = response[:1]
    return RewardResult(float(first in "13579" and first != ""), {"first": first})
