"""Chunked log-probs and entropy equal the plain full-softmax computation, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from reroll.algorithms.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy


def plain_logprobs(logits, ids, temperature):
    """The straightforward version: whole (B, T, V) in fp32, log_softmax, gather, shift."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), picked], dim=1)


def plain_entropy(logits, temperature):
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.cat([torch.zeros(logits.shape[0], 1), ent], dim=1)


def _inputs(dtype, seed=0, b=3, t=7, v=50):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, t, v, generator=gen)).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=gen)
    weights = torch.randn(b, t, generator=gen)  # a loss that weighs every position differently
    return logits, ids, weights


def test_hand_computed():
    # one row, V = 2, logits [0, ln 3] at position 0: p = [1/4, 3/4]; token 1 is id 1
    # log p = ln 3/4 = -0.287682; H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335
    logits = torch.tensor([[[0.0, math.log(3)], [5.0, -5.0]]])
    ids = torch.tensor([[0, 1]])
    logp, ent = token_logprobs_and_entropy(logits, ids)
    assert_close(logp, torch.tensor([[0.0, math.log(0.75)]]))
    assert_close(ent, torch.tensor([[0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 1, 4, 100])
def test_values_and_gradients_equal_plain(dtype, temperature, chunk):
    logits, ids, w = _inputs(dtype)
    want_lp, want_ent = plain_logprobs(logits, ids, temperature), plain_entropy(logits, temperature)
    got_lp, got_ent = token_logprobs_and_entropy(logits, ids, temperature, chunk_tokens=chunk)
    assert got_lp.dtype == got_ent.dtype == torch.float32
    assert_close(got_lp, want_lp)
    assert_close(got_ent, want_ent)
    assert_close(token_logprobs(logits, ids, temperature, chunk_tokens=chunk), want_lp)
    assert_close(token_entropy(logits, temperature, chunk_tokens=chunk), want_ent)

    # gradients: log-probs alone, entropy alone, and both in one loss
    for use_lp, use_ent in [(1.0, 0.0), (0.0, 1.0), (1.0, -0.3)]:
        x_plain = logits.float().detach().requires_grad_()
        want = use_lp * plain_logprobs(x_plain, ids, temperature)
        want = want + use_ent * plain_entropy(x_plain, temperature)
        (want * w).sum().backward()
        x = logits.detach().requires_grad_()
        lp, ent = token_logprobs_and_entropy(x, ids, temperature, chunk_tokens=chunk)
        ((use_lp * lp + use_ent * ent) * w).sum().backward()
        assert x.grad.dtype == dtype
        assert_close(x.grad, x_plain.grad.to(dtype))


def test_detached_entropy_gives_the_logprob_gradient():
    logits, ids, w = _inputs(torch.float32, seed=1)
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(x, ids, 0.7, chunk_tokens=2)
    ((lp + ent.detach()) * w).sum().backward()
    y = logits.clone().requires_grad_()
    (plain_logprobs(y, ids, 0.7) * w).sum().backward()
    assert_close(x.grad, y.grad)


def test_no_grad_keeps_nothing_and_column_zero_is_zero():
    logits, ids, _ = _inputs(torch.float32, seed=2)
    with torch.no_grad():
        lp, ent = token_logprobs_and_entropy(logits.requires_grad_(), ids, chunk_tokens=3)
    assert lp.grad_fn is None and ent.grad_fn is None
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    assert (lp[:, 1:] < 0).all() and (ent[:, 1:] > 0).all()


def test_zero_temperature_means_one():
    logits, ids, _ = _inputs(torch.float32, seed=3)
    assert_close(token_logprobs(logits, ids, 0.0), plain_logprobs(logits, ids, 1.0))


def test_non_contiguous_logits():
    logits, ids, _ = _inputs(torch.float32, seed=4, v=60)
    sliced = logits[..., :50]  # e.g. a padded vocabulary cut to the tokenizer's size
    assert not sliced.is_contiguous()
    assert_close(token_logprobs(sliced, ids % 50), plain_logprobs(sliced, ids % 50, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_a_mask_scores_its_columns_alone_with_the_same_values_and_gradients(dtype, chunk):
    """Response-only scoring: the marked columns as without the mask, the rest 0 with no gradient."""
    logits, ids, w = _inputs(dtype, b=4, t=9)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[0, 3:7], mask[1, 1:], mask[3, 8] = True, True, True  # row 2: nothing to score
    for use_lp, use_ent in [(1.0, 0.0), (0.0, 1.0), (1.0, -0.3)]:
        full = logits.detach().requires_grad_()
        lp, ent = token_logprobs_and_entropy(full, ids, 0.7, chunk_tokens=chunk)
        ((use_lp * lp + use_ent * ent) * w * mask).sum().backward()
        x = logits.detach().requires_grad_()
        m_lp, m_ent = token_logprobs_and_entropy(x, ids, 0.7, chunk_tokens=chunk, mask=mask)
        ((use_lp * m_lp + use_ent * m_ent) * w * mask).sum().backward()
        assert_close(m_lp, lp.detach() * mask)
        assert_close(m_ent, ent.detach() * mask)
        assert_close(x.grad, full.grad)
    assert_close(token_logprobs(logits, ids, 0.7, chunk_tokens=chunk, mask=mask), m_lp.detach())
    # the positions before unmarked columns got no gradient at all, not merely a small one
    before = torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False)
    assert (x.grad[~before] == 0).all()


@pytest.mark.parametrize("chunk", [None, 2])
def test_selected_rows_equal_the_masked_columns(chunk):
    """``selected_logprobs_and_entropy`` on the rows before the marked columns (the head run there
    alone) gives the masked values and, through the row selection, the same gradient."""
    from reroll.algorithms.logprobs import selected_logprobs_and_entropy

    logits, ids, w = _inputs(torch.float32, b=3, t=7, seed=5)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 2:5], mask[2, 1:] = True, True
    x = logits.detach().requires_grad_()
    lp, ent = token_logprobs_and_entropy(x, ids, 0.7, chunk_tokens=chunk, mask=mask)
    ((lp - 0.3 * ent) * w).sum().backward()
    rows, cols = torch.nn.functional.pad(mask[:, 1:], (0, 1), value=False).nonzero(as_tuple=True)
    y = logits.detach().requires_grad_()
    s_lp, s_ent = selected_logprobs_and_entropy(y[rows, cols], ids[rows, cols + 1], 0.7, chunk_tokens=chunk)
    ((s_lp - 0.3 * s_ent) * w[rows, cols + 1]).sum().backward()
    assert_close(s_lp, lp.detach()[rows, cols + 1])
    assert_close(s_ent, ent.detach()[rows, cols + 1])
    assert_close(y.grad, x.grad)
    no_entropy = selected_logprobs_and_entropy(y[rows, cols], ids[rows, cols + 1], 0.7, entropy=False)
    assert_close(no_entropy[0], s_lp.detach())
    assert (no_entropy[1] == 0).all()


def test_head_at_runs_the_head_on_the_chosen_positions_alone():
    """``head_at`` feeds the lm_head the chosen rows of its input: logits ``(1, K, V)`` equal to those
    rows of the full output; a model without one lm_head, or a compiled one, is left as it is."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reroll.roles.scored_tokens import head_at

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 6))
    positions = torch.tensor([1, 2, 7, 11])  # of the (2 * 6) positions
    with torch.no_grad():
        full = model(input_ids=ids).logits
        with head_at(model, positions) as selected:
            part = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert selected and part.shape == (1, 4, 50)
    assert_close(part[0], full.reshape(12, 50)[positions])
    assert_close(after, full)  # the hook is gone
    with head_at(model.model, positions) as selected:  # the base model: no lm_head
        assert not selected
