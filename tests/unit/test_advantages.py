"""Advantage estimators: hand-computed values, properties, and vectorised == plain loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from reroll.algorithms import (
    compute_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    outcome_to_tokens,
    raft_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    step_return_advantages,
)
from reroll.config.algorithm import AlgorithmConfig

# ---------------------------------------------------------------- hand-computed values


def test_grpo_group_std():
    # one group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, -a, -a, a])
    assert_close(grpo_advantages(rewards, torch.zeros(4, dtype=torch.long)), expected)


def test_grpo_std_none_is_dr_grpo():
    # Dr. GRPO: centred only. groups {0: [1, 0]} {1: [3, 1]} -> means 0.5, 2
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    expected = torch.tensor([0.5, -0.5, 1.0, -1.0])
    assert_close(grpo_advantages(rewards, groups, std_scale="none"), expected)


def test_grpo_batch_std_is_lite_ppo():
    # group means 0.5 and 2; batch std of [1, 0, 3, 1]: mean 1.25, sum sq dev 0.0625+1.5625+3.0625+0.0625 = 4.75,
    # unbiased var 4.75 / 3, std = sqrt(4.75 / 3)
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    std = math.sqrt(4.75 / 3) + 1e-6
    expected = torch.tensor([0.5, -0.5, 1.0, -1.0]) / std
    assert_close(grpo_advantages(rewards, groups, std_scale="batch"), expected)


def test_grpo_batch_std_uses_valid_samples_only():
    # with the last group invalid, the batch std is over [1, 0]: unbiased std sqrt(0.5)
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    valid = torch.tensor([True, True, False, False])
    out = grpo_advantages(rewards, groups, std_scale="batch", valid=valid)
    assert_close(out[:2], torch.tensor([0.5, -0.5]) / (math.sqrt(0.5) + 1e-6))


def test_rloo_leave_one_out():
    # [1, 0, 0, 1]: for a 1, the others average (0 + 0 + 1) / 3 = 1/3 -> 2/3; for a 0, (1 + 0 + 1) / 3 -> -2/3
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert_close(rloo_advantages(rewards, torch.zeros(4, dtype=torch.long)), expected)


def test_singleton_group_gets_zero_advantage():
    rewards = torch.tensor([5.0, 1.0, 2.0])
    groups = torch.tensor([7, 3, 3])  # group 7 has one sample
    assert rloo_advantages(rewards, groups)[0] == 0
    assert grpo_advantages(rewards, groups)[0] == 0


def test_remax_and_raft():
    # ReMax: r - r_greedy; RAFT++: 1 on rewards above the threshold
    assert_close(
        remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])), torch.tensor([0.5, -0.5])
    )
    assert_close(raft_advantages(torch.tensor([1.0, 0.0, 0.6])), torch.tensor([1.0, 0.0, 1.0]))


def test_outcome_to_tokens_puts_reward_on_last_response_token():
    mask = torch.tensor([[True, True, False], [False, True, True], [False, False, False]])
    out = outcome_to_tokens(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert_close(out, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]))


def test_gae_hand_computed():
    # rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 0.9, lambda 0.8 (gamma * lambda = 0.72)
    # delta_2 = 1 - 0.7 = 0.3;                   A_2 = 0.3
    # delta_1 = 0.9 * 0.7 - 0.6 = 0.03;          A_1 = 0.03 + 0.72 * 0.3 = 0.246
    # delta_0 = 0.9 * 0.6 - 0.5 = 0.04;          A_0 = 0.04 + 0.72 * 0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.3]]))
    assert_close(returns, torch.tensor([[0.71712, 0.846, 1.0]]))


def test_gae_skips_tokens_outside_the_mask():
    # an environment token between two turns (mask False) is skipped: same as the 2-token episode
    # rewards [0, 1], values [0.5, 0.7], gamma = lambda = 1: A = [1 - 0.5, 1 - 0.7]
    rewards = torch.tensor([[0.0, 9.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[True, False, True]])
    advantages, returns = gae_advantages(rewards, values, mask)
    assert_close(advantages, torch.tensor([[0.5, 0.0, 0.3]]))
    assert_close(returns, torch.tensor([[1.0, 0.0, 1.0]]))


def test_reinforce_pp_whitens_returns_over_the_batch():
    # rewards 1 and 0 on the last token, gamma 0.5: returns [[0.5, 1], [0, 0]]
    # mean 0.375, unbiased var (0.015625 + 0.390625 + 2 * 0.140625) / (4 - 1) = 0.6875 / 3 = 11/48
    token_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    advantages, returns = reinforce_pp_advantages(token_rewards, mask, gamma=0.5)
    assert_close(returns, torch.tensor([[0.5, 1.0], [0.0, 0.0]]))
    expected = (returns - 0.375) / math.sqrt(11 / 48 + 1e-8)
    assert_close(advantages, expected)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    # one group [1, 0]: centred [0.5, -0.5] on the last token; KL penalty -0.1 on every token
    # returns (gamma 1): [[0.5 - 0.2, 0.5 - 0.1], [-0.5 - 0.2, -0.5 - 0.1]] = [[0.3, 0.4], [-0.7, -0.6]]
    # mean -0.15, unbiased var (0.2025 + 0.3025 + 0.3025 + 0.2025) / (4 - 1) = 1.01 / 3
    mask = torch.ones(2, 2, dtype=torch.bool)
    penalty = torch.full((2, 2), -0.1)
    advantages, returns = reinforce_pp_baseline_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, token_penalty=penalty
    )
    assert_close(returns, torch.tensor([[0.3, 0.4], [-0.7, -0.6]]))
    assert_close(advantages, (returns + 0.15) / math.sqrt(1.01 / 3 + 1e-8))


def test_step_returns_hand_computed():
    # two turns with an environment token between them; turn rewards [1, 2], gamma 0.9
    # G_1 = 2, G_0 = 1 + 0.9 * 2 = 2.8; tokens [2.8, 2.8, -, 2, 2, -]
    # whitened over 4 tokens: mean 2.4, deviations +-0.4, unbiased var 4 * 0.16 / 3 = 0.64 / 3,
    # std 0.4 * sqrt(4/3) -> +-0.4 / (0.4 * sqrt(4/3)) = +-sqrt(3)/2 -> [h, h, 0, -h, -h, 0]
    step_ids = torch.tensor([[0, 0, -1, 1, 1, -1]])
    mask = step_ids >= 0
    advantages, returns = step_return_advantages(torch.tensor([[1.0, 2.0]]), step_ids, mask, gamma=0.9)
    assert_close(returns, torch.tensor([[2.8, 2.8, 0.0, 2.0, 2.0, 0.0]]))
    h = math.sqrt(3) / 2
    assert_close(advantages, torch.tensor([[h, h, 0.0, -h, -h, 0.0]]), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("std_scale", ["group", "batch", "none"])
def test_equal_rewards_in_a_group_give_zero_advantage(seed, std_scale):
    gen = torch.Generator().manual_seed(seed)
    group_size, groups = 4, 5
    rewards = torch.rand(groups, generator=gen).repeat_interleave(group_size)
    group_ids = torch.arange(groups).repeat_interleave(group_size)
    assert_close(grpo_advantages(rewards, group_ids, std_scale=std_scale), torch.zeros_like(rewards))
    assert_close(rloo_advantages(rewards, group_ids), torch.zeros_like(rewards))


def test_equal_rewards_give_zero_advantage_through_compute_advantages():
    mask = torch.ones(6, 3, dtype=torch.bool)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    for preset in ("grpo", "dr_grpo", "rloo", "lite_ppo", "gspo", "dapo"):
        result = compute_advantages(
            AlgorithmConfig(preset=preset, kl_coef=0.0),
            rewards=rewards,
            group_ids=groups,
            response_mask=mask,
            max_response_len=100,
        )
        assert_close(result.advantages, torch.zeros(6, 3), msg=preset)


@pytest.mark.parametrize("seed", range(5))
def test_rloo_is_scaled_group_centring(seed):
    # A_rloo = n / (n - 1) * (r - mean)
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.rand(12, generator=gen)
    groups = torch.arange(3).repeat_interleave(4)
    expected = 4 / 3 * grpo_advantages(rewards, groups, std_scale="none")
    assert_close(rloo_advantages(rewards, groups), expected)


# ---------------------------------------------------------------- vectorised == plain loop


def _random_batch(seed: int, batch: int = 5, length: int = 7):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, length, generator=gen) > 0.3
    mask[:, 0] = True
    return gen, mask


def _loop_gae(rewards, values, mask, gamma, lam):
    advantages = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        positions = [t for t in range(rewards.shape[1]) if mask[i, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            running = delta + gamma * lam * running
            advantages[i, t] = running
            next_value = float(values[i, t])
    return advantages


@pytest.mark.parametrize("seed", range(5))
def test_gae_equals_loop(seed):
    gen, mask = _random_batch(seed)
    rewards, values = torch.randn(*mask.shape, generator=gen), torch.randn(*mask.shape, generator=gen)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.95, lam=0.9)
    expected = _loop_gae(rewards, values, mask, 0.95, 0.9)
    assert_close(advantages, expected)
    assert_close(returns, torch.where(mask, expected + values, 0.0))


@pytest.mark.parametrize("seed", range(5))
def test_discounted_returns_equal_loop(seed):
    gen, mask = _random_batch(seed)
    rewards = torch.randn(*mask.shape, generator=gen)
    expected = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                running = float(rewards[i, t]) + 0.9 * running
                expected[i, t] = running
    assert_close(discounted_returns(rewards, mask, gamma=0.9), expected)


@pytest.mark.parametrize("seed", range(5))
def test_grpo_and_rloo_equal_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (10,), generator=gen).float()
    groups = torch.randint(0, 3, (10,), generator=gen) * 11  # sparse ids, uneven group sizes
    grpo_expected, rloo_expected = torch.zeros(10), torch.zeros(10)
    for i in range(10):
        members = [float(rewards[j]) for j in range(10) if groups[j] == groups[i]]
        n = len(members)
        if n < 2:
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1))
        grpo_expected[i] = (float(rewards[i]) - mean) / (std + 1e-6)
        rloo_expected[i] = float(rewards[i]) - (sum(members) - float(rewards[i])) / (n - 1)
    assert_close(grpo_advantages(rewards, groups), grpo_expected)
    assert_close(rloo_advantages(rewards, groups), rloo_expected)


@pytest.mark.parametrize("seed", range(5))
def test_step_returns_equal_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    step_ids = torch.tensor([[0, 0, -1, 1, 1, -1, 2, 2], [0, -1, 1, 1, 1, -1, -1, -1]])
    mask = step_ids >= 0
    step_rewards = torch.randn(2, 3, generator=gen)
    _, returns = step_return_advantages(step_rewards, step_ids, mask, gamma=0.8)
    expected = torch.zeros(2, 8)
    for i in range(2):
        turns = sorted({int(k) for k in step_ids[i] if k >= 0})
        for t in range(8):
            k = int(step_ids[i, t])
            if k >= 0:
                later = [j for j in turns if j >= k]
                expected[i, t] = sum(0.8 ** (n) * float(step_rewards[i, j]) for n, j in enumerate(later))
    assert_close(returns, expected)


# ---------------------------------------------------------------- compute_advantages glue


def test_compute_advantages_grpo_matches_pure_function():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[True, True, False]] * 6)
    result = compute_advantages(AlgorithmConfig(), rewards=rewards, group_ids=groups, response_mask=mask)
    expected = grpo_advantages(rewards, groups).unsqueeze(-1) * mask
    assert_close(result.advantages, expected)
    assert result.keep.all()
    assert result.returns is None
    assert_close(result.metrics["reward/mean"], torch.tensor(0.5))


def test_compute_advantages_reinforce_pp_kl_in_reward():
    # beta 0.1, k1 KL 0.5 on each of 2 tokens: token rewards [[-0.05, 1 - 0.05], [-0.05, -0.05]]
    cfg = AlgorithmConfig(preset="reinforce_pp", kl_coef=0.1)
    mask = torch.ones(2, 2, dtype=torch.bool)
    logprobs, ref = torch.full((2, 2), -1.0), torch.full((2, 2), -1.5)
    result = compute_advantages(
        cfg,
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 1]),
        response_mask=mask,
        logprobs=logprobs,
        ref_logprobs=ref,
    )
    assert_close(result.token_rewards, torch.tensor([[-0.05, 0.95], [-0.05, -0.05]]))
    assert_close(result.returns, torch.tensor([[0.9, 0.95], [-0.1, -0.05]]))
    assert_close(result.metrics["kl/reward_kl"], torch.tensor(0.5))


def test_compute_advantages_remax_kl_in_reward_charges_every_token_the_whole_kl():
    # beta 0.1, k1 KL = logprobs - ref = [0.5, 0.2] on each response: sum 0.7, penalty 0.07
    # score s_i = r_i - 0.07; greedy baseline b = 0.5 (no KL term): A_it = s_i - b on every token
    # sample 0: 1 - 0.07 - 0.5 = 0.43; sample 1: 0 - 0.07 - 0.5 = -0.57
    # (verl's remax is the reward-to-go minus b: token 0 of sample 0 gets 0.43, token 1 gets 1 - 0.02 - 0.5 = 0.48)
    cfg = AlgorithmConfig(adv_estimator="remax", kl_coef=0.1, kl_estimator="k1", kl_in="reward")
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.2], [-1.5, -1.2]])
    result = compute_advantages(
        cfg,
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 1]),
        response_mask=torch.ones(2, 2, dtype=torch.bool),
        logprobs=logprobs,
        ref_logprobs=ref,
        baseline_rewards=torch.tensor([0.5, 0.5]),
    )
    assert_close(result.advantages, torch.tensor([[0.43, 0.43], [-0.57, -0.57]]))


def test_compute_advantages_gae_needs_values_and_remax_needs_baseline():
    mask = torch.ones(2, 2, dtype=torch.bool)
    kwargs = dict(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), response_mask=mask)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(AlgorithmConfig(adv_estimator="gae"), **kwargs)
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantages(AlgorithmConfig(adv_estimator="remax"), **kwargs)
    result = compute_advantages(
        AlgorithmConfig(adv_estimator="gae"), values=torch.zeros(2, 2), **kwargs
    )  # gamma = lambda = 1, V = 0: A_t = reward
    assert_close(result.advantages, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_compute_advantages_raft_pp_keeps_positives_only():
    cfg = AlgorithmConfig(preset="raft_pp")
    mask = torch.ones(4, 2, dtype=torch.bool)
    result = compute_advantages(
        cfg,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        response_mask=mask,
    )
    assert result.keep.tolist() == [True, False, False, True]
    assert_close(result.advantages, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]))
    assert_close(result.metrics["filter/positive_only_dropped"], torch.tensor(2.0))
