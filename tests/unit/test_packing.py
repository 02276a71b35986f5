"""Micro-batches by a token budget, pack/unpack, and that Qwen2 attends only within each packed row."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from reroll.data.packing import micro_batches, pack, padding_stats, to_count, unpack
from reroll.data.types import TrainBatch
from reroll.models.loading import position_ids_from


def _batch(lengths: list[int], seed: int = 0) -> TrainBatch:
    """Right-padded rows of ``lengths`` real tokens (ids 3..15, pad 0); the response is each row's last half."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    cols = torch.arange(width)[None]
    n = torch.tensor(lengths)[:, None]
    mask = cols < n
    ids = torch.randint(3, 16, (len(lengths), width), generator=g) * mask
    return TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        response_mask=mask & (cols >= n // 2),
        group_ids=torch.arange(len(lengths)),
        advantages=torch.randn(len(lengths), width, generator=g) * mask,
        num_tokens=float((mask & (cols >= n // 2)).sum()),
        num_seqs=float(len(lengths)),
    )


def test_token_budget_closes_micro_batches_in_row_order():
    batch = _batch([3, 5, 2, 7, 1, 1])
    parts = micro_batches(batch, max_rows=None, max_tokens=8)
    # 3+5=8 fits; +2=10 > 8 closes. 2 alone (2+7=9 > 8). 7+1=8 fits; +1=9 > 8 closes. Then the last 1.
    assert [p.group_ids.tolist() for p in parts] == [[0, 1], [2], [3, 4], [5]]
    assert [p.input_ids.shape[1] for p in parts] == [5, 2, 7, 1]  # each trimmed to its longest row
    assert TrainBatch.concat([p.advantages for p in parts], width=7).equal(batch.advantages)
    assert all(p.num_tokens == batch.num_tokens and p.num_seqs == batch.num_seqs for p in parts)


def test_row_longer_than_budget_is_alone_and_rows_limit_applies_with_tokens():
    batch = _batch([10, 2, 2, 2])
    assert [len(p) for p in micro_batches(batch, max_rows=None, max_tokens=4)] == [1, 2, 1]
    # both limits: 2 rows at most, 100 tokens at most -> the rows limit decides
    assert [len(p) for p in micro_batches(batch, max_rows=2, max_tokens=100)] == [2, 2]


def test_rows_only_is_fixed_chunks():
    batch = _batch([4, 1, 6, 2, 3])
    fixed, ours = batch.chunks(2), micro_batches(batch, max_rows=2, max_tokens=None)
    assert [p.input_ids.tolist() for p in ours] == [p.input_ids.tolist() for p in fixed]
    assert micro_batches(batch.select(slice(0, 0)), max_rows=2, max_tokens=8) == []


def test_count_splits_the_heaviest_or_merges_the_lightest_neighbours():
    # greedy with 8 tokens: [3, 5] [2] [7, 1] [1] (token sums 8, 2, 8, 1)
    assert to_count([0, 2, 3, 5, 6], [3, 5, 2, 7, 1, 1], 5) == [
        0,
        2,
        3,
        4,
        5,
        6,
    ]  # tie of 8s: the later splits
    # neighbour sums 8 + 2 = 10, 2 + 8 = 10, 8 + 1 = 9: the last two merge
    assert to_count([0, 2, 3, 5, 6], [3, 5, 2, 7, 1, 1], 3) == [0, 2, 3, 6]
    batch = _batch([3, 5, 2, 7, 1, 1])
    parts = micro_batches(batch, max_rows=None, max_tokens=8, count=6)
    assert [len(p) for p in parts] == [1] * 6
    assert TrainBatch.concat([p.advantages for p in parts], width=7).equal(batch.advantages)
    with pytest.raises(ValueError, match="cannot cut 6 rows into 7 micro-batches"):
        micro_batches(batch, max_rows=None, max_tokens=8, count=7)
    with pytest.raises(ValueError, match="into 0 micro-batches"):
        to_count([0, 6], [1] * 6, 0)


def test_micro_batches_needs_a_limit():
    with pytest.raises(ValueError, match="set max_rows"):
        micro_batches(_batch([2]), max_rows=None, max_tokens=None)
    with pytest.raises(ValueError, match="max_tokens is 0"):
        micro_batches(_batch([2]), max_rows=None, max_tokens=0)


def test_pack_lays_rows_end_to_end_and_unpack_puts_them_back():
    batch = _batch([2, 3, 1])
    p = pack(batch)
    ids = batch.input_ids
    assert p.input_ids.tolist() == [[*ids[0, :2].tolist(), *ids[1, :3].tolist(), ids[2, 0].item()]]
    assert p.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
    assert p.cu_seqlens.tolist() == [0, 2, 5, 6] and p.cu_seqlens.dtype == torch.int32
    # a per-token output 10, 11, ... of the packed row goes back to its row and column, zeros on padding
    x = (torch.arange(6, dtype=torch.float32) + 10)[None, :, None].expand(1, 6, 2)
    out = unpack(x, p, width=4)
    assert out.shape == (3, 4, 2)
    assert out[..., 0].tolist() == [[10, 11, 0, 0], [12, 13, 14, 0], [15, 0, 0, 0]]


def test_unpack_is_differentiable_on_real_tokens():
    p = pack(_batch([2, 1]))
    x = torch.zeros(1, 3, requires_grad=True)
    (unpack(x, p, width=2) * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
    assert x.grad.tolist() == [[1.0, 2.0, 3.0]]  # row 1's padding column (4.0) takes no part


def test_unpack_checks_the_shape_and_pack_needs_tokens():
    p = pack(_batch([2, 1]))
    with pytest.raises(ValueError, match=r"shape \(1, 3, \.\.\.\)"):
        unpack(torch.zeros(1, 4), p, width=2)
    empty = _batch([2])
    empty.attention_mask[:] = False
    with pytest.raises(ValueError, match="no real tokens"):
        pack(empty)


def test_padding_stats():
    batch = _batch([4, 1, 1, 1])
    # rows of 2: [4, 1] -> 2x4 = 8 computed, 5 real; [1, 1] -> 2 computed, 2 real: padding 3
    assert padding_stats(batch.chunks(2), packed=False) == {"tokens": 7, "padding": 3, "micro_batches": 2}
    assert padding_stats(batch.chunks(2), packed=True)["padding"] == 0


@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core machine more threads make these small forwards ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _qwen2(cls: type, attn: str) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        use_sliding_window=False,
        use_cache=False,  # as every strategy sets it: with a KV cache transformers skips packed detection
        num_labels=1,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = cls(config).eval()
    if cls is Qwen2ForTokenClassification:
        torch.nn.init.normal_(model.score.weight, std=0.1)
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("cls", [Qwen2ForCausalLM, Qwen2ForTokenClassification])
def test_qwen2_packed_forward_equals_each_row_alone(attn, cls, one_thread):
    """fp32: the packed row's output, unpacked, equals each row run alone (no padding) to 1e-5."""
    model = _qwen2(cls, attn)
    batch = _batch([5, 1, 9, 3, 9])
    p = pack(batch)
    with torch.no_grad():
        packed = unpack(model(input_ids=p.input_ids, position_ids=p.position_ids).logits, p, width=9)
        padded = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids_from(batch.attention_mask),
        ).logits
        for b, n in enumerate(batch.attention_mask.sum(-1).tolist()):
            alone = model(input_ids=batch.input_ids[b : b + 1, :n]).logits[0]
            torch.testing.assert_close(packed[b, :n], alone, atol=1e-5, rtol=0)
            torch.testing.assert_close(padded[b, :n], alone, atol=1e-5, rtol=0)
        # the check can fail: one causal sequence over the pack (positions 0..L-1) lets rows see earlier rows
        leaky = unpack(model(input_ids=p.input_ids).logits, p, width=9)
    assert (leaky - packed)[batch.attention_mask].abs().max() > 1e-2
