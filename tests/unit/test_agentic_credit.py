"""Credit assignment for multi-turn episodes: GiGPO step groups, per-turn discounted returns, hand-computed."""

from __future__ import annotations

import torch

from reroll.algorithms.advantages import gigpo_advantages, step_group_ids
from reroll.algorithms.objective import compute_advantages
from reroll.config.algorithm import AlgorithmConfig

S3 = 3**-0.5  # 0.57735


def test_step_groups_need_the_same_episode_group_and_state():
    groups = torch.tensor([0, 0, 1])
    states = torch.tensor([[7, 8], [7, -1], [7, 8]])
    ids = step_group_ids(groups, states)
    # (0,7) twice -> one id; (0,8), (1,7), (1,8) each their own; -1 stays -1
    assert ids[0, 0] == ids[1, 0] and ids[1, 1] == -1
    assert len({int(ids[0, 0]), int(ids[0, 1]), int(ids[2, 0]), int(ids[2, 1])}) == 4


def test_gigpo_hand_computed():
    # three episodes of one seed; gamma 0.5; states s0=0, sA=1, sB=2
    #   ep0: s0 -> sA, rewards (0, 1): G = (0 + 0.5*1, 1) = (0.5, 1), return 1
    #   ep1: s0 -> sB, rewards (0, 0): G = (0, 0), return 0
    #   ep2: s0 -> sA, rewards (0, 0): G = (0, 0), return 0
    # episode advantages: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 1/sqrt(3)
    #   -> (2/sqrt(3), -1/sqrt(3), -1/sqrt(3))
    # step group s0: G (0.5, 0, 0), mean 1/6, std sqrt((1/9 + 2/36) / 2) = 1/sqrt(12)
    #   -> (2/sqrt(3), -1/sqrt(3), -1/sqrt(3)); step group sA: G (1, 0) -> (+1/sqrt(2), -1/sqrt(2));
    #   sB alone -> 0
    returns = torch.tensor([1.0, 0.0, 0.0])
    step_returns = torch.tensor([[0.5, 1.0], [0.0, 0.0], [0.0, 0.0]])
    states = torch.tensor([[0, 1], [0, 2], [0, 1]])
    adv = gigpo_advantages(returns, torch.zeros(3, dtype=torch.long), step_returns, states, eps=1e-9)
    r2 = 2**-0.5
    expected = torch.tensor([[2 * S3 + 2 * S3, 2 * S3 + r2], [-S3 - S3, -S3 + 0.0], [-S3 - S3, -S3 - r2]])
    torch.testing.assert_close(adv, expected)
    half = gigpo_advantages(
        returns, torch.zeros(3, dtype=torch.long), step_returns, states, step_weight=0.5, eps=1e-9
    )
    torch.testing.assert_close(half[:, 1], torch.tensor([2 * S3 + 0.5 * r2, -S3, -S3 - 0.5 * r2]))


def test_equal_rewards_give_zero_and_absent_turns_stay_zero():
    adv = gigpo_advantages(
        torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2, 2), torch.tensor([[0, 1], [0, -1]])
    )
    assert torch.equal(adv, torch.zeros(2, 2))


def _two_turn_batch():
    # two episodes of one seed, two turns each; tokens: [obs, t0, t0, obs, t1, pad]
    step_ids = torch.tensor([[-1, 0, 0, -1, 1, -1], [-1, 0, 0, -1, 1, -1]])
    mask = step_ids >= 0
    return step_ids, mask


def test_compute_advantages_gigpo_spreads_turn_values_over_tokens():
    step_ids, mask = _two_turn_batch()
    cfg = AlgorithmConfig(adv_estimator="gigpo", gamma=1.0, adv_eps=1e-9)
    out = compute_advantages(
        cfg,
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        response_mask=mask,
        step_ids=step_ids,
        step_rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
        step_states=torch.tensor([[5, 6], [5, 7]]),
    )
    # episode: (1, 0) -> +-1/sqrt(2); turn 0 (same state 5): G (1, 0) -> +-1/sqrt(2); turn 1 alone -> 0
    r2 = 2**-0.5
    row0 = torch.tensor([0, 2 * r2, 2 * r2, 0, r2, 0])
    torch.testing.assert_close(out.advantages, torch.stack([row0, -row0]))
    torch.testing.assert_close(out.returns[0], torch.tensor([0.0, 1, 1, 0, 1, 0]))


def test_step_return_discounts_per_turn_not_per_token():
    step_ids, mask = _two_turn_batch()
    cfg = AlgorithmConfig(adv_estimator="step_return", gamma=0.5)
    out = compute_advantages(
        cfg,
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 1]),
        response_mask=mask,
        step_ids=step_ids,
        step_rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
    )
    # ep0: G = (0 + 0.5 * 1, 1) = (0.5, 1) on its turns' tokens; ep1: zeros (before whitening)
    torch.testing.assert_close(out.returns[0], torch.tensor([0.0, 0.5, 0.5, 0, 1, 0]))
    assert torch.equal(out.returns[1], torch.zeros(6))
