"""The critic's clipped value loss: hand values, clipping on both sides, gradients, masked metrics."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from reroll.algorithms import value_loss


def test_unclipped_loss_is_half_squared_error():
    # 0.5 (V - R)^2: 0.5 * (1 - 0)^2 = 0.5, 0.5 * (2 - 2.5)^2 = 0.125, 0.5 * 0^2 = 0
    values = torch.tensor([[1.0, 2.0, 0.5]], requires_grad=True)
    returns = torch.tensor([[0.0, 2.5, 0.5]])
    loss, metrics = value_loss(
        values, values.detach() + 5.0, returns, torch.ones(1, 3, dtype=torch.bool), clip=None
    )
    assert_close(loss, torch.tensor([[0.5, 0.125, 0.0]]))
    loss.sum().backward()
    assert_close(values.grad, torch.tensor([[1.0, -0.5, 0.0]]))  # d/dV = V - R, old values ignored
    assert_close(metrics["critic/vf_clipfrac"], torch.tensor(0.0))


def test_clip_above_and_below_the_old_values():
    # c = 0.2, V_old = 0 everywhere, so clip(V) lies in [-0.2, 0.2]; l = 0.5 max((V - R)^2, (clip(V) - R)^2)
    # V=+0.5 R=+1: (0.5-1)^2 = 0.25, (0.2-1)^2 = 0.64  -> 0.32, clipped: no gradient
    # V=+0.5 R= 0: 0.25, (0.2-0)^2 = 0.04               -> 0.125, unclipped: gradient V - R = 0.5
    # V=-0.5 R=-1: 0.25, (-0.2+1)^2 = 0.64              -> 0.32, clipped: no gradient
    # V=-0.5 R= 0: 0.25, 0.04                           -> 0.125, unclipped: gradient -0.5
    # V=+0.1 R=+1: inside the range, both 0.81          -> 0.405, gradient -0.9
    values = torch.tensor([[0.5, 0.5, -0.5, -0.5, 0.1]], requires_grad=True)
    returns = torch.tensor([[1.0, 0.0, -1.0, 0.0, 1.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, metrics = value_loss(values, torch.zeros(1, 5), returns, mask, clip=0.2)
    assert_close(loss, torch.tensor([[0.32, 0.125, 0.32, 0.125, 0.405]]))
    loss.sum().backward()
    assert_close(values.grad, torch.tensor([[0.0, 0.5, 0.0, -0.5, -0.9]]))
    assert_close(metrics["critic/vf_clipfrac"], torch.tensor(2 / 5))


def test_metrics_cover_the_masked_tokens_only():
    # masked tokens: V = [1, 2, 2], R = [1, 2, 3]; the padding column (V = 100) is ignored
    # value_mean = 5/3; R - V = [0, 0, 1], Var = mean of squares about 1/3 = (1/9 + 1/9 + 4/9) / 3 = 2/9
    # Var[R] = (1 + 0 + 1) / 3 = 2/3, explained variance = 1 - (2/9) / (2/3) = 2/3
    values = torch.tensor([[1.0, 2.0, 100.0], [2.0, 100.0, 100.0]])
    returns = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    _, metrics = value_loss(values, values, returns, mask)
    assert_close(metrics["critic/value_mean"], torch.tensor(5 / 3))
    assert_close(metrics["critic/explained_variance"], torch.tensor(2 / 3))
    assert_close(metrics["critic/vf_clipfrac"], torch.tensor(0.0))


def test_perfect_values_explain_all_variance_and_have_zero_loss():
    returns = torch.tensor([[0.5, 1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = value_loss(returns.clone(), returns.clone(), returns, mask)
    assert_close(loss, torch.zeros(1, 4))
    assert_close(metrics["critic/explained_variance"], torch.tensor(1.0))
