"""A dense reward a tiny random model learns within a few steps (for the async tests), in a module of
its own so that a reward process imports only this."""

from __future__ import annotations

from reroll.rewards.base import RewardResult


def sevens(prompt, response, sample):
    """The share of the response's characters that are '7'."""
    return RewardResult(response.count("7") / max(1, len(response)))
