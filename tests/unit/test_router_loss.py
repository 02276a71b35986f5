"""The router's load-balancing loss and the experts' load (reroll.algorithms.router)."""

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from reroll.algorithms.router import expert_load_stats, load_balance_loss


def test_equals_transformers_loss_and_gradient_with_and_without_padding():
    torch.manual_seed(0)
    layers, batch, width, experts, k = 3, 2, 5, 4, 2
    logits = torch.randn(layers, batch * width, experts, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    for m in (None, mask):
        ours, counts = load_balance_loss(logits, None if m is None else m.bool(), top_k=k)
        theirs = load_balancing_loss_func(tuple(logits), experts, k, m)
        torch.testing.assert_close(ours.double(), theirs.double())
        (g_ours,) = torch.autograd.grad(ours, logits)
        (g_theirs,) = torch.autograd.grad(theirs, logits)
        torch.testing.assert_close(g_ours.double(), g_theirs.double())
        real = width * batch if m is None else int(mask.sum())
        assert counts.shape == (layers, experts) and counts.sum() == layers * real * k


def test_even_load_is_top_k_and_crowding_raises_it():
    # Every token's probabilities uniform over 4 experts: P_e = 1/4; top-2 of a tie picks 2 experts per
    # token. 8 tokens cycling the ties' order spread the picks evenly: f_e = 2/4, loss = 4 * 4 * 1/2 * 1/4 = 2.
    experts, k = 4, 2
    even = torch.zeros(1, 8, experts)
    even[0, torch.arange(8), torch.arange(8) % experts] = 1e-4  # break the tie towards expert n % 4 ...
    even[0, torch.arange(8), (torch.arange(8) + 1) % experts] = 1e-4  # ... and n+1 % 4
    loss, counts = load_balance_loss(even, None, top_k=k)
    torch.testing.assert_close(loss, torch.tensor(2.0), atol=1e-3, rtol=0)
    assert counts.tolist() == [[4.0, 4.0, 4.0, 4.0]]
    # every token sure of experts 0 and 1: f = (1, 1, 0, 0), P ~ (1/2, 1/2, 0, 0): loss ~ 4 * (1/2 + 1/2) = 4
    crowded = torch.tensor([10.0, 10.0, -10.0, -10.0]).expand(1, 8, experts)
    loss, _ = load_balance_loss(crowded, None, top_k=k)
    torch.testing.assert_close(loss, torch.tensor(4.0), atol=1e-3, rtol=0)


def test_padding_tokens_are_not_counted():
    logits = torch.randn(2, 6, 4)
    mask = torch.tensor([True, True, True, False, False, False])
    padded, counts = load_balance_loss(logits, mask, top_k=1)
    alone, alone_counts = load_balance_loss(logits[:, :3], None, top_k=1)
    torch.testing.assert_close(padded, alone)
    assert torch.equal(counts, alone_counts)


def test_load_stats():
    # 4 tokens, top 2 of 4 experts: layer 0 spreads its 8 assignments evenly (each expert gets half the
    # tokens: 2 * 2 / 8 = 0.5); layer 1 gives expert 0 every token (4 * 2 / 8 = 1), expert 1 two, the others none
    counts = torch.tensor([[2.0, 2.0, 2.0, 2.0], [4.0, 2.0, 1.0, 1.0]])
    stats = expert_load_stats(counts, top_k=2)
    assert stats["expert_load_max"] == 1.0 and stats["expert_load_min"] == 0.25
    # entropy of (1/2, 1/4, 1/8, 1/8) = 1.75 ln 2 over ln 4 = 0.875; layer 0's is 1
    torch.testing.assert_close(stats["expert_load_entropy"], torch.tensor((1 + 0.875) / 2))
