"""Policy losses, off-policy correction and the actor_loss glue: hand values, clipping, gradients, loops."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from reroll.algorithms import (
    actor_loss,
    cispo_loss,
    gspo_loss,
    mismatch_metrics,
    pg_loss,
    ppo_clip_loss,
    rollout_is_weights,
    topr_loss,
)
from reroll.algorithms.correction import scored_mismatch
from reroll.config.algorithm import AlgorithmConfig


def _logprobs_for_ratios(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs with grad, old_logprobs) whose ratio exp(logprobs - old) is ``ratios``, shape (1, n)."""
    old = torch.full((1, len(ratios)), -1.0)
    logprobs = (old + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    return logprobs, old


def test_ppo_clip_positive_and_negative_advantages():
    # eps 0.2 both sides. loss = max(-A r, -A clip(r, 0.8, 1.2))
    # A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped, no gradient)
    # A=+1, r=0.5 -> max(-0.5, -0.8) = -0.5 (not clipped)
    # A=-1, r=1.5 -> max(1.5, 1.2) = 1.5 (not clipped)
    # A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped, no gradient)
    logprobs, old = _logprobs_for_ratios([1.5, 0.5, 1.5, 0.5])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = ppo_clip_loss(logprobs, old, advantages, mask)
    assert_close(loss, torch.tensor([[-1.2, -0.5, 1.5, 0.8]]))
    loss.sum().backward()
    # d(-A r)/d logp = -A r where not clipped
    assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, 1.5, 0.0]]))
    assert_close(metrics["actor/clipfrac"], torch.tensor(0.5))
    assert_close(metrics["actor/clipfrac_high"], torch.tensor(0.25))
    assert_close(metrics["actor/clipfrac_low"], torch.tensor(0.25))


def test_clip_higher_leaves_room_above():
    # DAPO clip-higher: eps_high 0.28, r = 1.25, A = 1 -> not clipped: -1.25, gradient -1.25
    logprobs, old = _logprobs_for_ratios([1.25])
    loss, _ = ppo_clip_loss(
        logprobs, old, torch.tensor([[1.0]]), torch.ones(1, 1, dtype=torch.bool), clip_high=0.28
    )
    loss.sum().backward()
    assert_close(loss, torch.tensor([[-1.25]]))
    assert_close(logprobs.grad, torch.tensor([[-1.25]]))


def test_dual_clip_bounds_negative_advantage_loss():
    # A = -1, r = 5: PPO loss max(5, 1.2) = 5; dual clip c = 3 -> min(5, 3) = 3, no gradient
    logprobs, old = _logprobs_for_ratios([5.0, 2.0])
    advantages = torch.tensor([[-1.0, -1.0]])
    loss, metrics = ppo_clip_loss(
        logprobs, old, advantages, torch.ones(1, 2, dtype=torch.bool), dual_clip=3.0
    )
    assert_close(loss, torch.tensor([[3.0, 2.0]]))
    assert_close(metrics["actor/clipfrac_dual"], torch.tensor(0.5))
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.0, 2.0]]))


@pytest.mark.parametrize("seed", range(5))
def test_ppo_clip_gradient_vanishes_exactly_outside_the_trust_region(seed):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 16, generator=gen)
    logprobs = (old + 0.5 * torch.randn(4, 16, generator=gen)).requires_grad_(True)
    advantages = torch.randn(4, 16, generator=gen)
    loss, _ = ppo_clip_loss(logprobs, old, advantages, torch.ones(4, 16, dtype=torch.bool), clip_high=0.28)
    loss.sum().backward()
    ratio = torch.exp(logprobs.detach() - old)
    pushed_out = ((advantages > 0) & (ratio > 1.28)) | ((advantages < 0) & (ratio < 0.8))
    assert (logprobs.grad[pushed_out] == 0).all()
    assert (logprobs.grad[~pushed_out] != 0).all()
    # the objective -loss never exceeds A * (1 + eps_high) for A > 0, nor A * (1 - eps_low) for A < 0
    bound = torch.where(advantages > 0, advantages * 1.28, advantages * 0.8)
    assert (-loss.detach() <= bound + 1e-6).all()


@pytest.mark.parametrize("seed", range(5))
def test_ppo_clip_equals_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    old, new = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    advantages = torch.randn(3, 6, generator=gen)
    loss, _ = ppo_clip_loss(
        new, old, advantages, torch.ones(3, 6, dtype=torch.bool), clip_low=0.1, dual_clip=2.0
    )
    expected = torch.zeros(3, 6)
    for i in range(3):
        for t in range(6):
            a, r = float(advantages[i, t]), math.exp(float(new[i, t] - old[i, t]))
            value = max(-a * r, -a * min(max(r, 0.9), 1.2))
            expected[i, t] = min(value, -a * 2.0) if a < 0 else value
    assert_close(loss, expected)


def test_gspo_uses_one_ratio_per_sequence():
    # log-ratios [0.1, 0.3] -> s = exp(0.2); with eps_high 4e-4 and A = 1 the ratio is clipped: loss -1.0004
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[0.1, 0.3]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = gspo_loss(logprobs, old, torch.ones(1, 2), mask)
    assert_close(loss, torch.full((1, 2), -1.0004))
    assert_close(metrics["actor/seq_ratio_mean"], torch.tensor(math.exp(0.2)))
    # inside the clip range (log-ratios +-1e-4, mean 0: s = 1) the token gradient is -A * s = -1
    logprobs = torch.tensor([[1e-4, -1e-4]], requires_grad=True)
    loss, _ = gspo_loss(logprobs, old, torch.ones(1, 2), mask)
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0]]))


def test_cispo_keeps_gradient_of_clipped_tokens():
    # r = 2, eps_high 0.2 -> weight sg(1.2); loss = -1.2 * A * logp; gradient -1.2 * A (PPO would give 0)
    logprobs, old = _logprobs_for_ratios([2.0])
    loss, metrics = cispo_loss(logprobs, old, torch.tensor([[1.0]]), torch.ones(1, 1, dtype=torch.bool))
    assert_close(loss, -1.2 * logprobs.detach())
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[-1.2]]))
    assert_close(metrics["actor/clipfrac"], torch.tensor(1.0))


def test_topr_truncates_negatives_only():
    # A=+1, r=0.5 -> weight 1; A=-1, r=0.5 -> weight 0.5; A=-1, r=2 -> weight min(2, 1) = 1
    logprobs, old = _logprobs_for_ratios([0.5, 0.5, 2.0])
    advantages = torch.tensor([[1.0, -1.0, -1.0]])
    loss, _ = topr_loss(logprobs, old, advantages, torch.ones(1, 3, dtype=torch.bool))
    loss.sum().backward()
    # gradient of -alpha * A * logp is -alpha * A
    assert_close(logprobs.grad, torch.tensor([[-1.0, 0.5, 1.0]]))


def test_topr_sequence_level_ratio():
    # token ratios 0.5 and 0.5 -> trajectory ratio 0.25; A = -1 -> weight 0.25 on both tokens
    logprobs, old = _logprobs_for_ratios([0.5, 0.5])
    loss, _ = topr_loss(
        logprobs, old, torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool), level="sequence"
    )
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.25, 0.25]]))


def test_vanilla_pg_gradient_is_reinforce_on_policy():
    logprobs = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    loss, _ = pg_loss(
        logprobs, logprobs.detach(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    )
    assert_close(loss, torch.tensor([[-2.0, 1.0]]))  # -A * r with r = 1
    loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[-2.0, 1.0]]))


# ---------------------------------------------------------------- off-policy correction


def test_rollout_is_truncate_and_mask():
    # old - rollout log-ratios: ln 3, ln 0.5, ln 1.5 -> weights 3, 0.5, 1.5
    old = torch.zeros(1, 3)
    rollout = -torch.log(torch.tensor([[3.0, 0.5, 1.5]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    weights, metrics = rollout_is_weights(old, rollout, mask, max_weight=2.0)
    assert_close(weights, torch.tensor([[2.0, 0.5, 1.5]]))  # TIS: min(w, 2)
    assert_close(metrics["correction/clipped_frac"], torch.tensor(1 / 3))
    weights, _ = rollout_is_weights(old, rollout, mask, mode="mask", max_weight=2.0, min_weight=0.6)
    assert_close(weights, torch.tensor([[0.0, 0.0, 1.5]]))  # outside [0.6, 2] -> 0
    # sequence level: w = 3 * 0.5 * 1.5 = 2.25 -> truncated to 2 on every token
    weights, _ = rollout_is_weights(old, rollout, mask, level="sequence", max_weight=2.0)
    assert_close(weights, torch.full((1, 3), 2.0))


# ---------------------------------------------------------------- actor_loss glue


def test_mismatch_kl_estimates_kl_of_the_engine_from_the_trainer():
    """mismatch/kl: KL(engine || trainer) from tokens the engine sampled, against the exact value."""
    g = torch.Generator().manual_seed(0)
    engine = torch.log_softmax(torch.randn(50, generator=g), -1)
    trainer = torch.log_softmax(engine + 0.5 * torch.randn(50, generator=g), -1)
    exact = float((engine.exp() * (engine - trainer)).sum())
    tokens = torch.multinomial(engine.exp(), 200_000, replacement=True, generator=g)[None]
    m = mismatch_metrics(trainer[tokens], engine[tokens], torch.ones_like(tokens, dtype=torch.bool))
    assert m["mismatch/kl"] == pytest.approx(exact, rel=0.05)


def test_actor_loss_sums_its_terms():
    # token-mean over 2 tokens. ppo_clip with r = 1: pg = -A = [-1, 1] -> 0
    # k3 KL with log-ratio x = logp - ref = ln 2: exp(-x) - 1 + x = 0.5 - 1 + ln 2 on both tokens
    # entropy [1, 3] -> bonus -0.1 * 2 = -0.2 ; sft NLL on token 0 only: 0.5 * 0.5 / 2
    cfg = AlgorithmConfig(kl_coef=0.5, kl_estimator="k3", entropy_coef=0.1, sft_coef=0.5)
    logprobs = torch.tensor([[-0.5, -0.5]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = actor_loss(
        cfg,
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),
        advantages=torch.tensor([[1.0, -1.0]]),
        response_mask=mask,
        ref_logprobs=logprobs.detach() - math.log(2),
        entropy=torch.tensor([[1.0, 3.0]]),
        sft_mask=torch.tensor([[True, False]]),
    )
    k3 = 0.5 - 1 + math.log(2)
    expected = 0.0 + 0.5 * k3 - 0.2 + 0.5 * 0.5 / 2
    assert_close(loss, torch.tensor(expected))
    assert_close(metrics["actor/kl"], torch.tensor(k3))
    assert_close(metrics["actor/entropy"], torch.tensor(2.0))
    assert_close(metrics["actor/sft_loss"], torch.tensor(0.25))


def test_actor_loss_applies_rollout_weights_to_the_policy_term():
    # pg term -A * r = -1 per token; TIS weights [2 (truncated from 4), 0.5] -> token-mean (-2 - 0.5) / 2
    cfg = AlgorithmConfig(rollout_is="token", rollout_is_max=2.0)
    logprobs = torch.zeros(1, 2, requires_grad=True)
    rollout = -torch.log(torch.tensor([[4.0, 0.5]]))
    loss, metrics = actor_loss(
        cfg,
        logprobs=logprobs,
        old_logprobs=torch.zeros(1, 2),
        advantages=torch.ones(1, 2),
        response_mask=torch.ones(1, 2, dtype=torch.bool),
        rollout_logprobs=rollout,
    )
    assert_close(loss, torch.tensor(-1.25))
    assert "correction/mismatch_kl" in metrics


def test_actor_loss_asks_for_missing_inputs():
    kwargs = dict(
        logprobs=torch.zeros(1, 2),
        old_logprobs=None,
        advantages=torch.ones(1, 2),
        response_mask=torch.ones(1, 2, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="ref_logprobs"):
        actor_loss(AlgorithmConfig(kl_coef=0.1), **kwargs)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        actor_loss(AlgorithmConfig(rollout_is="token"), **kwargs)
    with pytest.raises(ValueError, match="entropy"):
        actor_loss(AlgorithmConfig(entropy_coef=0.01), **kwargs)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "topr", "pg"])
def test_every_policy_loss_runs_through_actor_loss(name):
    gen = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=gen)).requires_grad_(True)
    loss, metrics = actor_loss(
        AlgorithmConfig(policy_loss=name),
        logprobs=logprobs,
        old_logprobs=logprobs.detach() - 0.01,
        advantages=torch.randn(3, 5, generator=gen),
        response_mask=torch.ones(3, 5, dtype=torch.bool),
    )
    loss.backward()
    assert logprobs.grad.abs().sum() > 0
    assert {"actor/pg_loss", "actor/clipfrac", "actor/ratio_mean", "actor/approx_kl"} <= set(metrics)
    assert all(not v.requires_grad for v in metrics.values())


def test_scored_mismatch_is_the_masked_mismatch_exactly():
    """``scored_mismatch`` at the flat indices of ``mask`` (what the trainer passes, made on the host)
    reads the same elements in the same order as ``x[mask]``: the same sums, bit for bit."""
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(3, 7, generator=g) * 3
    engine = -torch.rand(3, 7, generator=g) * 3
    mask = torch.rand(3, 7, generator=g) > 0.4
    diff = (trainer - engine)[mask]  # the former selection, by the mask
    want = {
        "mismatch/logprob_abs_mean": diff.abs().mean(),
        "mismatch/logprob_abs_max": diff.abs().max(),
        "mismatch/kl": (diff.exp() - 1 - diff).mean(),
    }
    got = scored_mismatch(trainer, engine, mask.reshape(-1).nonzero().squeeze(-1))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert mismatch_metrics(trainer, engine, mask) == {k: float(v) for k, v in want.items()}
    assert mismatch_metrics(trainer, engine, torch.zeros_like(mask)) == {}  # no token: no metric
