"""Reward normalisation, clipping, overlong shaping, filters and masks, and the metrics they produce."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from reroll.algorithms import (
    RunningMeanStd,
    clip_symmetric,
    compute_advantages,
    difficulty_mask,
    equal_reward_mask,
    normalize_rewards,
    overlong_mask,
    overlong_penalty,
    pass_rate,
    raft_mask,
    update_running_mean_std,
)
from reroll.config.algorithm import AlgorithmConfig


def test_overlong_penalty_hand_computed():
    # L_max 20, L_cache 4: no penalty up to 16, linear to -1 at 20, -1 beyond
    # 18 -> (16 - 18) / 4 = -0.5 ; 19 -> -0.75
    lengths = torch.tensor([10, 16, 18, 19, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.5, -0.75, -1.0, -1.0])
    assert_close(overlong_penalty(lengths, max_len=20, buffer_len=4), expected)
    assert_close(overlong_penalty(lengths, max_len=20, buffer_len=4, penalty_factor=0.5), expected / 2)


def test_overlong_mask_drops_truncated():
    lengths = torch.tensor([5, 20, 20])
    assert overlong_mask(lengths, max_len=20).tolist() == [True, False, False]
    # the engine's finish reason wins over the length
    truncated = torch.tensor([False, False, True])
    assert overlong_mask(lengths, max_len=20, truncated=truncated).tolist() == [True, True, False]


def test_equal_reward_groups_are_dropped():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 3 is alone: all (one) rewards equal
    assert equal_reward_mask(rewards, groups).tolist() == [False, False, True, True, False, False, False]


def test_difficulty_and_raft_masks():
    # pass rates: group 0 -> 3/4, group 1 -> 1/4
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert_close(pass_rate(rewards, groups), torch.tensor([0.75] * 4 + [0.25] * 4))
    keep = difficulty_mask(rewards, groups, min_pass_rate=0.5, max_pass_rate=1.0)
    assert keep.tolist() == [True] * 4 + [False] * 4
    assert raft_mask(rewards).tolist() == [True, True, True, False, True, False, False, False]


def test_normalisation_modes():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    # group: group 0 mean 2, unbiased std sqrt(2) -> [-1/sqrt2, 1/sqrt2]; group 1 all equal -> 0
    out, _ = normalize_rewards(rewards, groups, mode="group")
    a = 1 / (math.sqrt(2) + 1e-6)
    assert_close(out, torch.tensor([-a, a, 0.0, 0.0]))
    # batch: mean 2, unbiased var (1 + 1 + 0 + 0) / 3 -> std sqrt(2/3)
    out, _ = normalize_rewards(rewards, groups, mode="batch")
    assert_close(out, (rewards - 2) / (math.sqrt(2 / 3) + 1e-6))
    out, stats = normalize_rewards(rewards, groups, mode="none")
    assert_close(out, rewards)
    assert stats is None


def test_running_normalisation_carries_state():
    # first batch [1, 3]: mean 2, unbiased var (1 + 1) / (2 - 1) = 2 -> [-1/sqrt2, 1/sqrt2]
    # (the stats keep the population var (1 + 1) / 2 = 1 for the merge)
    out, stats = normalize_rewards(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), mode="running", eps=0.0)
    assert_close(out, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2)]))
    assert_close(stats.var, torch.tensor(1.0, dtype=torch.float64))
    # second batch [5]: all of [1, 3, 5] -> mean 3, unbiased var (4 + 0 + 4) / (3 - 1) = 4, std 2
    # -> (5 - 3) / 2 = 1 (stored population var 8/3)
    out, stats = normalize_rewards(
        torch.tensor([5.0]), torch.tensor([0]), mode="running", stats=stats, eps=0.0
    )
    assert_close(out, torch.tensor([1.0]))
    assert_close(stats.var, torch.tensor(8 / 3, dtype=torch.float64))
    assert_close(stats.count, torch.tensor(3.0, dtype=torch.float64))


def test_running_normalisation_of_a_single_reward_is_zero():
    # n = 1: std 0 (the n = 1 rule) and 4 - mean 4 = 0, so 0 / (0 + eps) = 0, not NaN
    out, stats = normalize_rewards(torch.tensor([4.0]), torch.tensor([0]), mode="running")
    assert_close(out, torch.tensor([0.0]))
    assert_close(stats.var, torch.tensor(0.0, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(5))
def test_running_stats_equal_stats_of_everything_seen(seed):
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(int(n), generator=gen) for n in torch.randint(1, 6, (4,), generator=gen)]
    stats = RunningMeanStd.initial()
    for batch in batches:
        stats = update_running_mean_std(stats, batch)
    seen = torch.cat(batches).double()
    assert_close(stats.mean, seen.mean())
    assert_close(stats.var, seen.var(unbiased=False))


def test_running_stats_ignore_an_empty_batch():
    stats = update_running_mean_std(RunningMeanStd.initial(), torch.tensor([1.0, 3.0]))
    same = update_running_mean_std(stats, torch.tensor([7.0]), valid=torch.tensor([False]))
    assert_close(same.mean, stats.mean)
    assert_close(same.var, stats.var)


def test_clip_symmetric():
    assert_close(clip_symmetric(torch.tensor([-5.0, 0.5, 5.0]), clip=2.0), torch.tensor([-2.0, 0.5, 2.0]))


# ---------------------------------------------------------------- through compute_advantages, with metrics


def test_dapo_filters_and_shapes_with_metrics():
    # groups of 2; group 0 rewards [1, 0], group 1 [1, 1] (dropped: all equal)
    # max_response_len 8, buffer 4 (check: expected length 4): lengths [2, 6, 3, 3] -> penalties [0, -0.5, 0, 0]
    cfg = AlgorithmConfig(preset="dapo", overlong_buffer_len=4)
    mask = torch.arange(8).unsqueeze(0) < torch.tensor([2, 6, 3, 3]).unsqueeze(1)
    result = compute_advantages(
        cfg,
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        response_mask=mask,
        max_response_len=8,
    )
    assert result.keep.tolist() == [True, True, False, False]
    m = result.metrics
    assert_close(m["filter/equal_reward_dropped"], torch.tensor(2.0))
    assert_close(m["filter/kept_groups"], torch.tensor(1.0))
    assert_close(m["filter/total_groups"], torch.tensor(2.0))
    assert_close(m["reward/overlong_penalty_mean"], torch.tensor(-0.125))
    assert_close(m["reward/overlong_frac"], torch.tensor(0.25))
    # group 0 shaped rewards [1, -0.5]: mean 0.25, unbiased std sqrt(2 * 0.5625) -> +-0.75 / 1.06066
    a = 0.75 / (math.sqrt(1.125) + 1e-6)
    assert_close(result.advantages[0, :2], torch.tensor([a, a]))
    assert_close(result.advantages[1, :6], torch.full((6,), -a))
    assert (result.advantages[2:] == 0).all()


def test_overlong_filter_and_clipping_through_compute_advantages():
    cfg = AlgorithmConfig(
        adv_estimator="grpo", std_scale="none", overlong_filter=True, reward_clip=1.0, adv_clip=0.3
    )
    mask = torch.ones(4, 4, dtype=torch.bool)
    result = compute_advantages(
        cfg,
        rewards=torch.tensor([2.0, 0.0, 1.0, 0.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        response_mask=mask,
        truncated=torch.tensor([False, False, False, True]),
    )
    assert result.keep.tolist() == [True, True, True, False]
    assert_close(result.metrics["filter/overlong_dropped"], torch.tensor(1.0))
    assert_close(result.metrics["reward/clip_frac"], torch.tensor(0.25))
    # rewards clipped to [1, 0, 1, 0] -> centred +-0.5 -> advantages clipped to +-0.3; the truncated sample gets 0
    assert_close(result.advantages[:, 0], torch.tensor([0.3, -0.3, 0.3, 0.0]))


def test_overlong_options_need_the_max_length():
    with pytest.raises(ValueError, match="max_response_len"):
        compute_advantages(
            AlgorithmConfig(preset="dapo"),
            rewards=torch.tensor([1.0, 0.0]),
            group_ids=torch.tensor([0, 0]),
            response_mask=torch.ones(2, 2, dtype=torch.bool),
        )


def test_difficulty_mask_through_compute_advantages():
    cfg = AlgorithmConfig(difficulty_min=0.2, difficulty_max=0.8)
    rewards = torch.tensor(
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    )  # pass rates: group 0 -> 1, group 1 -> 0.5, group 2 -> 0
    result = compute_advantages(
        cfg,
        rewards=rewards,
        group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
        response_mask=torch.ones(6, 1, dtype=torch.bool),
    )
    assert result.keep.tolist() == [False, False, True, True, False, False]
    assert_close(result.metrics["filter/difficulty_dropped"], torch.tensor(4.0))


def test_running_reward_norm_state_round_trip():
    cfg = AlgorithmConfig(adv_estimator="reinforce_pp", reward_norm="running")
    kwargs = dict(group_ids=torch.tensor([0, 1]), response_mask=torch.ones(2, 1, dtype=torch.bool))
    first = compute_advantages(cfg, rewards=torch.tensor([1.0, 3.0]), **kwargs)
    second = compute_advantages(cfg, rewards=torch.tensor([5.0, 7.0]), state=first.state, **kwargs)
    assert_close(second.state.reward_stats.count, torch.tensor(4.0, dtype=torch.float64))
    assert_close(second.state.reward_stats.mean, torch.tensor(4.0, dtype=torch.float64))
