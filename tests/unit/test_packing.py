"""Micro-batches by a token budget, pack/unpack, and that Qwen2 attends only within each packed row
(transformers' sdpa and eager block masks, and ``packed_attention``'s rows apart)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from reroll.data.packing import micro_batches, pack, padding_stats, to_count, unpack
from reroll.data.types import TrainBatch
from reroll.models import packed_attention
from reroll.models.loading import position_ids_from
from reroll.models.packed_attention import attend_rows_apart, packed_kwargs


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
    config._attn_implementation = "sdpa" if attn == packed_attention.NAME else attn
    torch.manual_seed(0)
    model = cls(config).eval()
    if attn == packed_attention.NAME:
        assert attend_rows_apart(model)
    if cls is Qwen2ForTokenClassification:
        torch.nn.init.normal_(model.score.weight, std=0.1)
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager", packed_attention.NAME])
@pytest.mark.parametrize("cls", [Qwen2ForCausalLM, Qwen2ForTokenClassification])
def test_qwen2_packed_forward_equals_each_row_alone(attn, cls, one_thread):
    """fp32: the packed row's output, unpacked, equals each row run alone (no padding) to 1e-5."""
    model = _qwen2(cls, attn)
    batch = _batch([5, 1, 9, 3, 9])
    p = pack(batch)
    with torch.no_grad():
        packed = unpack(model(input_ids=p.input_ids, position_ids=p.position_ids).logits, p, width=9)
        if attn == packed_attention.NAME:  # the rows' bounds given, as forward_logits gives them
            bounds = packed_kwargs(p.position_ids, torch.device("cpu"))
            assert bounds["cu_seq_lens_q"].tolist() == [0, 5, 6, 15, 18, 27] and bounds["max_length_q"] == 9
            given = model(input_ids=p.input_ids, position_ids=p.position_ids, **bounds).logits
            torch.testing.assert_close(unpack(given, p, width=9), packed, atol=1e-6, rtol=0)
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


def _varlen_reference(params: set[str]):
    """A stand-in for torch's CUDA-only ``varlen_attn`` with the parameters of one torch release, computed
    row by row with sdpa, which records how it was called."""
    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options):
        assert set(options) <= params and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        assert options.get("window_size", (-1, 0)) == (-1, 0) and options.get("is_causal", True)
        calls.append(options)
        # kv heads as they are where the kernel takes grouped-query attention, else repeated
        assert (k.shape[1] < q.shape[1]) == bool(options.get("enable_gqa"))
        rows = [
            torch.nn.functional.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)),
                is_causal=True,
                scale=options.get("scale"),
                enable_gqa=k.shape[1] != q.shape[1],
            ).transpose(0, 1)
            for a, b in zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], strict=True)
        ]
        return torch.cat(rows)

    return varlen_attn, calls


@pytest.mark.parametrize(
    "params",
    [{"window_size", "scale", "enable_gqa"}, {"window_size", "scale"}, {"is_causal"}],
    ids=["torch-2.12", "torch-2.10", "torch-2.9"],
)
def test_varlen_kernel_is_called_as_each_torch_release_wants(params, monkeypatch):
    """``_flash_rows`` (the CUDA path) gives what row-by-row sdpa gives, whichever of torch's
    ``varlen_attn`` signatures it meets: causal as a window or a flag, kv heads repeated where the
    kernel has no grouped-query flag, and a non-default scale taken to sdpa where it cannot be passed."""
    fn, calls = _varlen_reference(params)
    monkeypatch.setattr(packed_attention, "_varlen", lambda: (fn, frozenset(params)))
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(12, 4, 8, generator=g),
        torch.randn(12, 2, 8, generator=g),
        torch.randn(12, 2, 8, generator=g),
    )
    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    for scale in (8**-0.5, 0.2):
        want = packed_attention._rows_one_by_one(q, k, v, cu, scale, 0.0)
        got = packed_attention._flash_rows(q, k, v, cu, 6, scale)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert len(calls) == (2 if "scale" in params else 1)
    assert ("enable_gqa" in calls[0]) == ("enable_gqa" in params)


def test_rows_apart_only_where_the_model_allows_it():
    """Eager attention and sliding windows keep their own attention; padded rows through the switched
    model still get sdpa's mask (same logits as before the switch)."""
    assert not attend_rows_apart(_qwen2(Qwen2ForCausalLM, "eager"))
    config = _qwen2(Qwen2ForCausalLM, "sdpa").config
    config.use_sliding_window, config.sliding_window = True, 4
    windowed = Qwen2ForCausalLM(config)
    assert not attend_rows_apart(windowed) and windowed.config._attn_implementation == "sdpa"
    batch = _batch([5, 1, 9, 3, 9])
    before = _qwen2(Qwen2ForCausalLM, "sdpa")
    after = _qwen2(Qwen2ForCausalLM, packed_attention.NAME)
    args = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    with torch.no_grad():
        mask = batch.attention_mask
        torch.testing.assert_close(after(**args).logits[mask], before(**args).logits[mask], atol=1e-6, rtol=0)


def test_packing_none_resolves_on_where_the_varlen_kernel_runs(monkeypatch):
    """``optim.packing: null``: on for a model computing in half precision on CUDA where torch has
    ``varlen_attn``, off on CPU, in fp32 or without it; true and false are kept as set."""
    from reroll.models.packed_attention import wants_packing

    cuda, cpu, bf16, fp32 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16, torch.float32
    monkeypatch.setattr(packed_attention, "_varlen", lambda: (None, frozenset()))
    assert wants_packing(None, cuda, bf16) and wants_packing(None, cuda, torch.float16)
    assert not wants_packing(None, cpu, bf16) and not wants_packing(None, cuda, fp32)
    assert wants_packing(True, cpu, fp32) and not wants_packing(False, cuda, bf16)
    monkeypatch.setattr(packed_attention, "_varlen", lambda: None)
    assert not wants_packing(None, cuda, bf16)


@pytest.mark.parametrize("packing", [None, True, False])
def test_strategy_switches_the_attention_as_packing_resolves(packing, assets):
    """On CPU ``null`` keeps padded rows and sdpa; ``true`` packs on the rows-apart attention."""
    from reroll.config.schema import RunConfig
    from reroll.strategies.torch_strategy import TorchStrategy

    raw = {"pipeline": "rlvr", "model": {"path": str(assets["model"])}, "data": {"train_files": ["x.jsonl"]}}
    cfg = RunConfig.model_validate(raw | {"optim": {"packing": packing}})
    s = TorchStrategy(cfg.model.path, cfg=cfg)
    assert packed_attention.uses_packed_attention(s.model) == bool(packing)


def test_packed_attention_skips_transformers_search_for_packed_rows(monkeypatch, one_thread):
    """With ``packed_attention`` and no attention mask, transformers is not asked to search the positions
    for packed rows (on a GPU its ``.all()`` made the host wait at every forward, for a mask ``_mask``
    does not build; the outputs are checked above); a model on sdpa still is (its block mask needs it)."""
    from transformers import masking_utils

    searched = []
    find = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(
        masking_utils, "find_packed_sequence_indices", lambda pos: searched.append(1) or find(pos)
    )
    p = pack(_batch([5, 1, 9]))
    with torch.no_grad():
        rows_apart = _qwen2(Qwen2ForCausalLM, packed_attention.NAME)
        bounds = packed_kwargs(p.position_ids, torch.device("cpu"))
        rows_apart(input_ids=p.input_ids, position_ids=p.position_ids, **bounds)
        assert searched == []
        _qwen2(Qwen2ForCausalLM, "sdpa")(input_ids=p.input_ids, position_ids=p.position_ids)
    assert searched == [1]
