"""KL estimators and the KL controller."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from reroll.algorithms import (
    AdvantageState,
    RunningMeanStd,
    UnknownAlgorithmError,
    adaptive_kl_coef,
    compute_advantages,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    kl_reward_penalty,
)
from reroll.config.algorithm import AlgorithmConfig


def test_estimators_hand_computed():
    # pi = 0.5, pi_ref = 0.25: x = log 2
    # k1 = ln 2 = 0.693147; k2 = (ln 2)^2 / 2 = 0.240227; k3 = 0.25/0.5 - 1 + ln 2 = 0.193147; abs = ln 2
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    ln2 = math.log(2)
    assert_close(kl_k1(logp, ref), torch.tensor([ln2]))
    assert_close(kl_k2(logp, ref), torch.tensor([ln2**2 / 2]))
    assert_close(kl_k3(logp, ref), torch.tensor([0.5 - 1 + ln2]))
    assert_close(kl_abs(ref, logp), torch.tensor([ln2]))


def test_k1_and_k3_are_unbiased_in_expectation():
    # E_{y~p}[k1] = E_{y~p}[k3] = KL(p || q) exactly, over a 5-way categorical
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)
    exact = (p * (p.log() - q.log())).sum()
    assert_close((p * kl_k1(p.log(), q.log())).sum(), exact)
    assert_close((p * kl_k3(p.log(), q.log())).sum(), exact)


@pytest.mark.parametrize("seed", range(3))
def test_k2_k3_abs_are_non_negative_and_zero_at_equality(seed):
    gen = torch.Generator().manual_seed(seed)
    logp, ref = -torch.rand(4, 8, generator=gen) * 5, -torch.rand(4, 8, generator=gen) * 5
    for name in ("k2", "k3", "abs"):
        assert (kl_penalty(logp, ref, estimator=name) >= 0).all()
        assert_close(kl_penalty(logp, logp, estimator=name), torch.zeros(4, 8))


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(UnknownAlgorithmError, match=r"'k1', 'k2', 'k3', 'abs'.*'low_var_kl' is 'k3'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), estimator="low_var_kl")


def test_reward_penalty_is_minus_beta_kl_on_the_mask():
    # k1 = 0.5 per token, beta 0.2 -> -0.1 on response tokens, 0 on padding
    mask = torch.tensor([[True, True, False]])
    penalty, kl = kl_reward_penalty(
        torch.full((1, 3), -1.0), torch.full((1, 3), -1.5), mask, kl_coef=0.2, estimator="k1"
    )
    assert_close(penalty, torch.tensor([[-0.1, -0.1, 0.0]]))
    assert_close(kl, torch.tensor([[0.5, 0.5, 0.0]]))


def test_adaptive_controller_moves_towards_target():
    # KL 0.2 vs target 0.1: error clip(1, -0.2, 0.2) = 0.2 -> beta * (1 + 0.2 * 100 / 1000) = 0.1 * 1.02
    assert_close(adaptive_kl_coef(0.1, 0.2, target=0.1, horizon=1000, n_steps=100), torch.tensor(0.102))
    # KL 0.05: error -0.5 clipped to -0.2 -> 0.1 * 0.98
    assert_close(adaptive_kl_coef(0.1, 0.05, target=0.1, horizon=1000, n_steps=100), torch.tensor(0.098))


def test_compute_advantages_carries_the_adaptive_coefficient():
    # per-token k1 KL 0.5 > target 0.1 -> the coefficient grows: 0.05 * (1 + 0.2 * 2 / 10) = 0.052
    cfg = AlgorithmConfig(
        preset="reinforce_pp", kl_coef=0.05, kl_controller="adaptive", kl_target=0.1, kl_horizon=10
    )
    kwargs = dict(
        rewards=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 1]),
        response_mask=torch.ones(2, 3, dtype=torch.bool),
        logprobs=torch.full((2, 3), -1.0),
        ref_logprobs=torch.full((2, 3), -1.5),
    )
    first = compute_advantages(cfg, **kwargs)
    assert_close(first.metrics["kl/coef"], torch.tensor(0.05))
    assert_close(first.state.kl_coef, torch.tensor(0.052))
    second = compute_advantages(cfg, state=first.state, **kwargs)
    assert_close(second.metrics["kl/coef"], torch.tensor(0.052))


def test_kl_in_reward_without_logprobs_says_what_to_pass():
    with pytest.raises(ValueError, match="logprobs and ref_logprobs"):
        compute_advantages(
            AlgorithmConfig(preset="rloo"),
            rewards=torch.tensor([1.0, 0.0]),
            group_ids=torch.tensor([0, 0]),
            response_mask=torch.ones(2, 2, dtype=torch.bool),
        )


def test_advantage_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    state = AdvantageState(kl_coef=torch.tensor(0.052), reward_stats=RunningMeanStd.initial())
    torch.save(state.state_dict(), tmp_path / "algorithm_state.pt")
    loaded = AdvantageState.from_state_dict(torch.load(tmp_path / "algorithm_state.pt", weights_only=True))
    assert_close(loaded.kl_coef, state.kl_coef)
    assert_close(loaded.reward_stats.var, state.reward_stats.var)
