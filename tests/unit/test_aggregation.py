"""Loss aggregation: each mode by hand, micro-batched and data-parallel == full batch, and loops."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from reroll.algorithms import (
    UnknownAlgorithmError,
    actor_loss,
    aggregate,
    count_tokens_and_seqs,
    group_std,
    grpo_advantages,
    masked_var,
    masked_whiten,
)
from reroll.algorithms.aggregation import masked_stats
from reroll.config.algorithm import AlgorithmConfig

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

# two sequences: [1, 2, 3] (3 tokens) and [4, -, -] (1 token), T = 3; NaN in padding must not leak
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("nan")]])
MASK = torch.tensor([[True, True, True], [True, False, False]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # (2 + 4) / 2 = 3
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 3)),  # Dr. GRPO, L = T = 3: 10 / 6
    ],
)
def test_each_mode_by_hand(mode, expected):
    assert_close(aggregate(LOSS, MASK, mode=mode), torch.tensor(expected))


def test_norm_len_and_global_counts():
    # seq-mean-token-sum-norm with L = 10 and 4 sequences in the optimizer step: 10 / (4 * 10)
    assert_close(
        aggregate(LOSS, MASK, mode="seq-mean-token-sum-norm", norm_len=10, num_seqs=4), torch.tensor(0.25)
    )
    # token-mean with 8 tokens in the step: 10 / 8
    assert_close(aggregate(LOSS, MASK, mode="token-mean", num_tokens=8), torch.tensor(1.25))


def test_empty_rows_do_not_count_as_sequences():
    mask = torch.tensor([[True, True, True], [False, False, False]])
    assert_close(aggregate(LOSS, mask, mode="seq-mean-token-sum"), torch.tensor(6.0))
    assert count_tokens_and_seqs(mask)[1] == 1


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(UnknownAlgorithmError, match="'token-mean', 'seq-mean-token-mean'"):
        aggregate(LOSS, MASK, mode="token_mean")


def _random_step(seed: int, batch: int = 8, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    mask[batch - 1] = False  # one sequence filtered out entirely
    return gen, mask


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_sum_to_the_full_batch(seed, mode):
    gen, mask = _random_step(seed)
    values = torch.randn(*mask.shape, generator=gen)
    full = aggregate(values, mask, mode=mode, norm_len=6)
    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    parts = [
        aggregate(
            values[i : i + 3],
            mask[i : i + 3],
            mode=mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_len=6,
        )
        for i in range(0, 8, 3)
    ]
    assert_close(sum(parts), full)


def _trim(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cut the micro-batch to its own longest response, as dynamic padding does."""
    width = int(mask.sum(dim=-1).max().clamp(min=1))
    return t[:, :width]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_name", ["ppo_clip", "gspo", "cispo", "topr", "pg"])
def test_actor_loss_data_parallel_equals_full_batch(mode, loss_name):
    # 2 ranks x 2 micro-batches, each padded to its own length; the global counts are all-reduced
    gen, mask = _random_step(7)
    old = -torch.rand(*mask.shape, generator=gen)
    new = old + 0.3 * torch.randn(*mask.shape, generator=gen)
    inputs = dict(
        old_logprobs=old,
        advantages=torch.randn(*mask.shape, generator=gen),
        response_mask=mask,
        ref_logprobs=old - 0.1,
        entropy=torch.rand(*mask.shape, generator=gen),
    )
    cfg = AlgorithmConfig(
        policy_loss=loss_name,
        loss_agg_mode=mode,
        kl_coef=0.1,
        entropy_coef=0.01,
        sft_coef=0.1,
        loss_norm_len=6,
    )
    full, _ = actor_loss(cfg, logprobs=new, **inputs)
    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    total = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)):  # rank 0: mb 0, 1; rank 1: mb 2, 3
        part = {k: _trim(v[rows], mask[rows]) for k, v in inputs.items()}
        loss, _ = actor_loss(
            cfg, logprobs=_trim(new[rows], mask[rows]), num_tokens=num_tokens, num_seqs=num_seqs, **part
        )
        total = total + loss
    assert_close(total, full)


def test_micro_batched_gradient_equals_full_batch_gradient():
    gen, mask = _random_step(3)
    old = -torch.rand(*mask.shape, generator=gen)
    advantages = torch.randn(*mask.shape, generator=gen)
    cfg = AlgorithmConfig(loss_agg_mode="token-mean")
    full_lp = (old + 0.1).requires_grad_(True)
    loss, _ = actor_loss(cfg, logprobs=full_lp, old_logprobs=old, advantages=advantages, response_mask=mask)
    loss.backward()
    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    micro_lp = (old + 0.1).requires_grad_(True)
    for rows in (slice(0, 4), slice(4, 8)):
        part, _ = actor_loss(
            cfg,
            logprobs=micro_lp[rows],
            old_logprobs=old[rows],
            advantages=advantages[rows],
            response_mask=mask[rows],
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        part.backward()
    assert_close(micro_lp.grad, full_lp.grad)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_equals_loop(seed, mode):
    gen, mask = _random_step(seed)
    values = torch.randn(*mask.shape, generator=gen)
    seqs = [[float(values[i, t]) for t in range(6) if mask[i, t]] for i in range(8)]
    seqs = [s for s in seqs if s]
    if mode == "token-mean":
        expected = sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    elif mode == "seq-mean-token-mean":
        expected = sum(sum(s) / len(s) for s in seqs) / len(seqs)
    elif mode == "seq-mean-token-sum":
        expected = sum(sum(s) for s in seqs) / len(seqs)
    else:
        expected = sum(sum(s) for s in seqs) / (len(seqs) * 6)
    assert_close(aggregate(values, mask, mode=mode), torch.tensor(expected))


@pytest.mark.parametrize("seed", range(3))
def test_whiten_and_group_std_equal_loop(seed):
    gen, mask = _random_step(seed)
    values = torch.randn(*mask.shape, generator=gen)
    picked = [float(values[i, t]) for i in range(8) for t in range(6) if mask[i, t]]
    mean = sum(picked) / len(picked)
    std = (sum((v - mean) ** 2 for v in picked) / (len(picked) - 1) + 1e-8) ** 0.5  # unbiased
    expected = torch.where(mask, (values - mean) / std, 0.0)
    assert_close(masked_whiten(values, mask), expected)
    rewards, groups = values[:, 0], torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    for i in range(8):
        members = [float(rewards[j]) for j in range(8) if groups[j] == groups[i]]
        m = sum(members) / len(members)
        s = (sum((x - m) ** 2 for x in members) / (len(members) - 1)) ** 0.5
        assert_close(group_std(rewards, groups)[i], torch.tensor(s))


# ---------------------------------------------------------------- whitening: unbiased (n - 1), n = 1 rule


def test_whiten_hand_computed_all_valid():
    # [1, 2, 3, 4]: mean 2.5, deviations [-1.5, -0.5, 0.5, 1.5]
    # unbiased var (2.25 + 0.25 + 0.25 + 2.25) / (4 - 1) = 5/3 (the biased 5/4 is what we no longer use)
    # -> [-1.5, -0.5, 0.5, 1.5] / sqrt(5/3 + 1e-8) ~ [-1.16190, -0.38730, 0.38730, 1.16190]
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    assert_close(masked_var(values, mask), torch.tensor(5 / 3))
    assert_close(masked_var(values, mask, unbiased=False), torch.tensor(5 / 4))
    expected = torch.tensor([[-1.5, -0.5], [0.5, 1.5]]) / math.sqrt(5 / 3 + 1e-8)
    assert_close(masked_whiten(values, mask), expected)
    # shift_mean=False adds the mean 2.5 back
    assert_close(masked_whiten(values, mask, shift_mean=False), expected + 2.5)


def test_whiten_hand_computed_masked():
    # valid [1, 2, 4] (NaN and 9 outside the mask are never read): mean 7/3, deviations [-4/3, -1/3, 5/3]
    # unbiased var (16/9 + 1/9 + 25/9) / (3 - 1) = (42/9) / 2 = 7/3 -> divide by sqrt(7/3 + 1e-8)
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert_close(masked_var(values, mask), torch.tensor(7 / 3))
    std = math.sqrt(7 / 3 + 1e-8)
    expected = torch.tensor([[-4 / 3 / std, -1 / 3 / std, 0.0], [5 / 3 / std, 0.0, 0.0]])
    assert_close(masked_whiten(values, mask), expected)
    # the std metric is unbiased too: sqrt(7/3)
    assert_close(masked_stats(values, mask, prefix="adv")["adv/std"], torch.tensor(math.sqrt(7 / 3)))


def test_whiten_single_valid_value_gives_zero_not_nan():
    # n = 1: sum of squares 0 over n - 1 = 0 would be 0/0; the rule is var 0 (group_std's rule for a group
    # of one), and the value minus its own mean is exactly 0, so it whitens to 0 (0 * rsqrt(1e-8) = 0)
    values = torch.tensor([[3.0, 7.0], [5.0, 1.0]])
    one = torch.tensor([[False, True], [False, False]])
    assert_close(masked_var(values, one), torch.tensor(0.0))
    assert_close(masked_whiten(values, one), torch.zeros(2, 2))
    assert_close(masked_whiten(values, one, shift_mean=False), torch.tensor([[0.0, 7.0], [0.0, 0.0]]))
    assert_close(masked_stats(values, one, prefix="adv")["adv/std"], torch.tensor(0.0))
    # the same rule in the group statistics: a group of one has std 0 and GRPO advantage 0
    rewards, groups = torch.tensor([7.0, 1.0, 2.0]), torch.tensor([0, 1, 1])
    assert_close(group_std(rewards, groups)[0], torch.tensor(0.0))
    assert_close(grpo_advantages(rewards, groups)[0], torch.tensor(0.0))
    # and an empty mask gives zeros as well
    none = torch.zeros(2, 2, dtype=torch.bool)
    assert_close(masked_whiten(values, none), torch.zeros(2, 2))


@pytest.mark.parametrize("seed", range(5))
def test_whitened_values_have_mean_zero_and_unbiased_std_one_over_the_mask(seed):
    gen, mask = _random_step(seed)
    values = 3.0 + 2.0 * torch.randn(*mask.shape, generator=gen)
    values = torch.where(mask, values, float("nan"))  # padding must not leak
    white = masked_whiten(values, mask)
    picked = white[mask]
    assert_close(picked.mean(), torch.tensor(0.0))
    assert_close(picked.std(), torch.tensor(1.0))  # torch.std divides by n - 1
    assert_close(masked_var(values, mask), values[mask].var())
    assert_close(masked_stats(white, mask, prefix="adv")["adv/std"], torch.tensor(1.0))
    assert torch.equal(white[~mask], torch.zeros_like(white[~mask]))
