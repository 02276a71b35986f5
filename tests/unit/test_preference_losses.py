"""The preference losses against hand-computed values (log sigmoid(1) = -0.313262, log sigmoid(-1) = -1.313262)."""

from __future__ import annotations

import math

import pytest
import torch

from reroll.algorithms.preference import DPO_LOSSES, bradley_terry_loss, dpo_loss, sequence_logprob

LS1 = math.log(1 / (1 + math.exp(-1)))  # log sigmoid(1) = -0.313262
LSM1 = math.log(1 / (1 + math.exp(1)))  # log sigmoid(-1) = -1.313262


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_sequence_logprob_sums_or_averages_the_response():
    logprobs = t(0.0, -1.0, -2.0, -3.0)[None]
    mask = torch.tensor([[False, False, True, True]])
    assert sequence_logprob(logprobs, mask).item() == pytest.approx(-5.0)  # -2 + -3
    assert sequence_logprob(logprobs, mask, average=True).item() == pytest.approx(-2.5)  # -5 / 2 tokens


def test_bradley_terry_loss_margin_and_centring():
    chosen, rejected = t(2.0, 0.0), t(1.0, 1.0)
    loss, m = bradley_terry_loss(chosen, rejected)
    # pair 0: diff 1 -> -log sigmoid(1); pair 1: diff -1 -> -log sigmoid(-1)
    torch.testing.assert_close(loss, t(-LS1, -LSM1))
    torch.testing.assert_close(m["accuracy"], t(1.0, 0.0))
    torch.testing.assert_close(m["margin"], t(1.0, -1.0))
    loss, _ = bradley_terry_loss(chosen, rejected, margin=1.0)  # diff - 1: 0 and -2
    torch.testing.assert_close(loss, t(math.log(2.0), math.log(1 + math.exp(2.0))))
    loss, _ = bradley_terry_loss(chosen, rejected, center_coef=0.1)  # + 0.1 (r_c + r_r)^2: 0.9 and 0.1
    torch.testing.assert_close(loss, t(-LS1 + 0.9, -LSM1 + 0.1))


# policy log-probs -1 (chosen), -3 (rejected); reference -2 both: chosen ratio +1, rejected -1, h = 2
POLICY, REF = (t(-1.0), t(-3.0)), (t(-2.0), t(-2.0))


@pytest.mark.parametrize(
    ("loss", "kwargs", "expected"),
    [
        ("sigmoid", {"beta": 0.5}, -LS1),  # -log sigmoid(0.5 * 2)
        ("sigmoid", {"beta": 0.5, "label_smoothing": 0.1}, -0.9 * LS1 - 0.1 * LSM1),  # cDPO: 0.413261
        ("robust", {"beta": 0.5, "label_smoothing": 0.1}, (-0.9 * LS1 + 0.1 * LSM1) / 0.8),  # 0.188261
        ("robust", {"beta": 0.5}, -LS1),  # no flipped labels: plain DPO
        ("ipo", {"beta": 0.5}, 1.0),  # (2 - 1 / (2 * 0.5))^2
        ("ipo", {"beta": 0.25}, 0.0),  # (2 - 2)^2
        ("hinge", {"beta": 0.25}, 0.5),  # max(0, 1 - 0.25 * 2)
        ("hinge", {"beta": 0.5}, 0.0),  # max(0, 1 - 1)
    ],
)
def test_dpo_losses_by_hand(loss, kwargs, expected):
    value, m = dpo_loss(*POLICY, *REF, loss=loss, **kwargs)
    torch.testing.assert_close(value, t(expected))
    beta = kwargs["beta"]
    torch.testing.assert_close(m["rewards/chosen"], t(beta * 1.0))  # beta (log pi - log ref) of y_c
    torch.testing.assert_close(m["rewards/rejected"], t(beta * -1.0))
    torch.testing.assert_close(m["margins"], t(2 * beta))
    torch.testing.assert_close(m["accuracy"], t(1.0))


def test_simpo_is_reference_free_with_a_margin():
    # length-averaged log-probs -0.5 and -1.5, beta 2, gamma 1: -log sigmoid(2 * 1 - 1)
    value, m = dpo_loss(t(-0.5), t(-1.5), None, None, loss="simpo", beta=2.0, simpo_gamma=1.0)
    torch.testing.assert_close(value, t(-LS1))
    torch.testing.assert_close(m["rewards/chosen"], t(-1.0))  # beta * l_c
    torch.testing.assert_close(m["margins"], t(2.0))


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    for loss in DPO_LOSSES:
        chosen, rejected = t(-1.0).requires_grad_(), t(-1.0).requires_grad_()
        ref = None if loss == "simpo" else t(-1.0)
        value, _ = dpo_loss(chosen, rejected, ref, ref, loss=loss, beta=0.1, label_smoothing=0.0)
        value.sum().backward()
        assert chosen.grad.item() < 0 < rejected.grad.item(), loss  # descent raises chosen, lowers rejected


def test_dpo_needs_reference_except_simpo_and_knows_its_names():
    with pytest.raises(ValueError, match="needs the reference"):
        dpo_loss(t(-1.0), t(-2.0), None, None, loss="sigmoid")
    with pytest.raises(ValueError, match="the DPO losses are"):
        dpo_loss(t(-1.0), t(-2.0), None, None, loss="kto")


def test_pair_losses_split_into_micro_batches_add_up():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(8, generator=g, dtype=torch.float64) for _ in range(4))
    full, _ = dpo_loss(pc, pr, rc, rr, beta=0.3)
    parts = [dpo_loss(pc[s], pr[s], rc[s], rr[s], beta=0.3)[0].sum() / 8 for s in (slice(0, 3), slice(3, 8))]
    torch.testing.assert_close(sum(parts), full.mean())
