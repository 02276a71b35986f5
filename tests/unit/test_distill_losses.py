"""Distillation losses and the top-k log-prob helpers: hand-computed values, gradients, plain equivalents."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from reroll.algorithms.distill import forward_kl_topk_loss, reverse_kl_pg_loss, reverse_kl_topk_loss
from reroll.algorithms.logprobs import token_logprobs_at, token_topk


def test_reverse_kl_hand_computed():
    # two response tokens: log pi_S = [ln .5, ln .25], log pi_T = [ln .25, ln .25]
    # gap (the per-token KL sample) = [ln 2, 0]; loss_t = gap_t * log pi_S(y_t); mean gap = ln 2 / 2
    s = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]], requires_grad=True)
    t = torch.tensor([[0.0, math.log(0.25), math.log(0.25)]])
    mask = torch.tensor([[False, True, True]])
    loss, m = reverse_kl_pg_loss(s, t, mask)
    assert_close(loss, torch.tensor([[0.0, math.log(2) * math.log(0.5), 0.0]]))
    assert_close(m["distill/reverse_kl"], torch.tensor(math.log(2) / 2))
    loss.sum().backward()
    # d/d log pi_S = gap (stop-gradient through the advantage): pushes down a token the teacher dislikes
    assert_close(s.grad, torch.tensor([[0.0, math.log(2), 0.0]]))


def test_reverse_kl_gradient_is_the_true_kl_gradient_in_expectation():
    # one position, V = 3: E_{y~pi_S}[grad of loss] = grad KL(pi_S || pi_T) exactly (sum over y weighted by pi_S)
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([1.0, 0.0, -1.0]), -1)
    logp = torch.log_softmax(theta, -1)
    one = torch.ones(1, 1, dtype=torch.bool)
    expected = sum(
        logp[y].exp().detach() * reverse_kl_pg_loss(logp[y].view(1, 1), teacher[y].view(1, 1), one)[0].sum()
        for y in range(3)
    )
    (g,) = torch.autograd.grad(expected, theta, retain_graph=True)
    kl = (logp.exp() * (logp - teacher)).sum()
    (g_true,) = torch.autograd.grad(kl, theta)
    assert_close(g, g_true)


def test_forward_kl_topk_hand_computed():
    # teacher top-2 log-probs [ln .6, ln .2] renormalise to q = [.75, .25]; student log-probs of the same
    # ids [ln .5, ln .25]: KL = .75 ln(.75/.5) + .25 ln(.25/.25) = .75 ln 1.5 = 0.304099
    teacher = torch.log(torch.tensor([[[0.6, 0.2]]]))
    student = torch.log(torch.tensor([[[0.5, 0.25]]]))
    target = torch.log(torch.tensor([[0.5]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = forward_kl_topk_loss(student, teacher, target, mask)
    assert_close(loss, torch.tensor([[0.75 * math.log(1.5)]]))
    # with ce_weight .5: .5 * KL + .5 * (-ln .5)
    mixed, m = forward_kl_topk_loss(student, teacher, target, mask, ce_weight=0.5)
    assert_close(mixed, torch.tensor([[0.5 * 0.75 * math.log(1.5) + 0.5 * math.log(2)]]))
    assert_close(m["distill/ce"], torch.tensor(math.log(2)))


def test_forward_kl_is_zero_when_the_student_matches_the_full_teacher():
    logits = torch.randn(2, 4, 5)
    logp = torch.log_softmax(logits, -1)
    loss, _ = forward_kl_topk_loss(logp, logp, logp[..., 0], torch.ones(2, 4, dtype=torch.bool))
    assert_close(loss, torch.zeros(2, 4), atol=1e-6, rtol=0)


def test_logprobs_at_ids_equal_the_plain_gather_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=gen, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6, 4), generator=gen)
    w = torch.randn(3, 6, 4, generator=gen)
    got = token_logprobs_at(logits, ids, chunk_tokens=5)  # chunks that cut rows
    plain = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:])
    plain = torch.cat([torch.zeros(3, 1, 4), plain], dim=1)
    assert_close(got, plain)
    (g,) = torch.autograd.grad((got * w).sum(), logits)
    (g_plain,) = torch.autograd.grad((plain * w).sum(), logits)
    assert_close(g, g_plain)


def test_topk_is_aligned_and_sorted():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]]])
    values, ids = token_topk(logits, 2)
    # column 1 is scored off position 0: ids [1, 2], log-probs log_softmax([0, 2, 1])[[1, 2]]
    assert ids.tolist() == [[[0, 0], [1, 2]]]
    assert_close(values[0, 1], torch.log_softmax(logits[0, 0], -1)[[1, 2]])
    assert_close(values[0, 0], torch.zeros(2))


def test_reverse_kl_topk_is_the_exact_kl_with_the_whole_vocabulary():
    gen = torch.Generator().manual_seed(1)
    student = torch.log_softmax(torch.randn(2, 3, 5, generator=gen), -1)
    teacher_full = torch.log_softmax(torch.randn(2, 3, 5, generator=gen), -1)
    top, ids = teacher_full.topk(5, dim=-1)
    mask = torch.tensor([[False, True, True], [True, True, False]])
    loss, m = reverse_kl_topk_loss(student, top, ids, mask)
    exact = (student.exp() * (student - teacher_full)).sum(-1)
    assert_close(loss, exact * mask)
    assert_close(m["distill/reverse_kl"], exact[mask].mean())


def test_reverse_kl_topk_spreads_the_teacher_rest_evenly():
    # V = 3, teacher top-1: token 0 with p = .5; the other two get (1 - .5) / 2 = .25 each
    # student uniform: KL = sum 1/3 (ln 1/3 - ln q) = 1/3 (ln(2/3) + 2 ln(4/3))
    student = torch.full((1, 1, 3), math.log(1 / 3))
    top, ids = torch.tensor([[[math.log(0.5)]]]), torch.tensor([[[0]]])
    loss, _ = reverse_kl_topk_loss(student, top, ids, torch.ones(1, 1, dtype=torch.bool))
    assert_close(loss, torch.tensor([[(math.log(2 / 3) + 2 * math.log(4 / 3)) / 3]]))
