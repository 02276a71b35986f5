"""Reward functions for test_reward_isolation, in a module of their own so that a reward process
imports only this (the test module imports torch and Ray, seconds per process)."""

from __future__ import annotations

import os

from reroll.rewards.base import RewardResult


def forever(prompt, response, sample, *, pid_file):
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    while True:
        pass


def crash(prompt, response, sample):
    raise RuntimeError("reward bug")


def die(prompt, response, sample):
    os._exit(3)


def whoami(prompt, response, sample):
    return RewardResult(float(len(response)), {"pid": os.getpid()})


def trl_style(response, answer, **kwargs):
    """A reward written for TRL: the row's fields as keywords."""
    return RewardResult(float(response == answer), {"fields": len(kwargs)})
