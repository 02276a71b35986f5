"""Each Megatron rank reads its share of a Hugging Face checkpoint from the safetensors files
(``mc.rank_from_hf`` over ``CheckpointReader``): the same state dict, bit for bit, as converting the whole
model that transformers loads and splitting it (stage, then experts, then TP), for every simulated rank;
and no more bytes read than the rank holds. Pure functions: no process group is started."""

from __future__ import annotations

import logging
import types
from typing import ClassVar

import pytest
import safetensors
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from reroll.models import megatron_convert as mc
from reroll.models.checkpoint_reader import CheckpointReader, checkpoint_files
from reroll.models.loading import DTYPES, load_causal_lm

COMMON = dict(
    vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
)  # fmt: skip  # 3 layers: pipeline stages of 1 and 2; vocabulary 37: padded to 38 at TP 2
CONFIGS = {
    "qwen2_tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),  # qkv bias, tied embeddings
    "qwen3": lambda: Qwen3Config(**COMMON, tie_word_embeddings=False),  # q/k norms, a head of its own
    "moe": lambda: Qwen3MoeConfig(
        **COMMON, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
    ),
    "moe_tied": lambda: Qwen3MoeConfig(
        **COMMON, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=True
    ),
}
SIZES = [(pp, tp, ep) for pp in (1, 2) for tp in (1, 2) for ep in (1, 2)]  # (pipeline, tensor, expert)


def _save(root, name: str, *, max_shard_size: str | None = None, safe: bool = True):
    """The model ``name`` with weights away from their init (norms too), saved under ``root``."""
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    path = root / name
    if safe:
        model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    else:  # a .bin checkpoint: what transformers still loads, with no safetensors file
        config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path, mc.gpt_shape(config)


def _today(full: dict[str, torch.Tensor], s: mc.GPTShape, stage, pp, tp_rank, tp, ep_rank, ep, fused_norms):
    """The rank's state dict as the strategy made it before it read per rank: the whole model converted,
    then split by stage, experts and TP."""
    mega = mc.hf_to_megatron(full, s, fused_norms=fused_norms, padded_vocab=s.padded_vocab(tp))
    return mc.shard(mc.shard_experts(mc.shard_stage(mega, s, stage, pp), s, ep_rank, ep), s, tp_rank, tp)


def _ranks(pp: int, tp: int, ep: int):
    return [(st, t, e) for st in range(pp) for t in range(tp) for e in range(ep)]


def _assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_rank_reads_what_the_whole_model_split_gives(tmp_path, name, dtype):
    """Every (stage, TP rank, EP rank) at PP 1/2, TP 1/2, EP 1/2 (EP for the mixtures of experts only),
    both norm namings, from a checkpoint split over several files (an index): bit-equal."""
    path, s = _save(tmp_path, name, max_shard_size="20KB")
    files = checkpoint_files(path)
    assert len(set(files.values())) > 1  # the index's several files were read, not one
    full = load_causal_lm(path, dtype, "cpu").state_dict()
    checked = 0
    for pp, tp, ep in SIZES:
        if ep > 1 and not s.num_experts:
            continue
        for stage, tp_rank, ep_rank in _ranks(pp, tp, ep):
            for fused_norms in (False, True):
                where = dict(stage=stage, pp=pp, tp_rank=tp_rank, tp=tp, ep_rank=ep_rank, ep=ep)
                theirs = _today(full, s, *where.values(), fused_norms)
                with CheckpointReader(files, DTYPES[dtype]) as reader:
                    _assert_same(mc.rank_from_hf(reader, s, **where, fused_norms=fused_norms), theirs)
                # the fallback: the same from transformers' state dict (fused experts, chunks cut in memory)
                _assert_same(mc.rank_from_hf(full, s, **where, fused_norms=fused_norms), theirs)
                checked += 1
    assert checked == 2 * (27 if s.num_experts else 9)  # (1+2)^3 or (1+2)^2 ranks, both namings


class _Counted:
    """``safetensors.safe_open``, counting the bytes each read returns (``get_tensor`` and a
    ``get_slice``'s slices) into ``read``."""

    read: ClassVar[dict[str, int]] = {"bytes": 0, "calls": 0}
    real = staticmethod(safetensors.safe_open)

    def __init__(self, *args, **kwargs):
        self.inner = self.real(*args, **kwargs)

    def __enter__(self):
        self.handle = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def get_tensor(self, name):
        return self.count(self.handle.get_tensor(name))

    def get_slice(self, name):
        return _CountedSlice(self.handle.get_slice(name))

    def __getattr__(self, attr):
        return getattr(self.handle, attr)

    @classmethod
    def count(cls, t):
        cls.read["bytes"] += t.numel() * t.element_size()
        cls.read["calls"] += 1
        return t


class _CountedSlice:
    def __init__(self, inner):
        self.inner = inner

    def __getitem__(self, index):
        return _Counted.count(self.inner[index])

    def get_shape(self):
        return self.inner.get_shape()


@pytest.mark.parametrize(("name", "pp", "tp", "ep"), [("moe", 2, 1, 2), ("moe", 2, 2, 2), ("qwen3", 2, 2, 1)])
def test_a_rank_reads_no_more_than_it_holds(tmp_path, monkeypatch, name, pp, tp, ep):
    """Every rank of a PP 2 checkpoint: the bytes its reads return (every get_tensor and get_slice of
    every file opened, counted by wrapping ``safetensors.safe_open``) are at most the bytes of the state
    dict it holds (replicated norms and router are held by each rank that reads them; vocabulary padding
    is held, not read). At TP 1 over the four ranks of PP 2 x EP 2, each expert is read once and every
    other weight twice (by both EP ranks of its stage)."""
    path, s = _save(tmp_path, name, max_shard_size="20KB")
    files = checkpoint_files(path)
    whole = load_causal_lm(path).state_dict()
    total = sum(t.numel() * t.element_size() for t in whole.values())
    experts = sum(t.numel() * t.element_size() for k, t in whole.items() if ".experts." in k)
    monkeypatch.setattr(safetensors, "safe_open", _Counted)
    summed = 0
    for stage, tp_rank, ep_rank in _ranks(pp, tp, ep):
        _Counted.read.update(bytes=0, calls=0)
        where = dict(stage=stage, pp=pp, tp_rank=tp_rank, tp=tp, ep_rank=ep_rank, ep=ep)
        with CheckpointReader(files, torch.float32) as reader:
            ours = mc.rank_from_hf(reader, s, **where)
        held = sum(t.numel() * t.element_size() for t in ours.values())
        assert _Counted.read["calls"] > 0  # the reads went through the wrapper
        assert 0 < _Counted.read["bytes"] <= held, where
        summed += _Counted.read["bytes"]
    if tp == 1:
        assert summed == 2 * (total - experts) + experts


def test_the_strategy_reads_a_bin_checkpoint_whole_and_says_so(tmp_path, caplog):
    """``MegatronStrategy._load_hf`` on a ``.bin`` checkpoint (no safetensors files) falls back to
    transformers and logs it; on safetensors it reads per rank. Both give the same weights."""
    from reroll.strategies.megatron import MegatronStrategy

    loaded = []

    class Module:
        def load_state_dict(self, sd, strict):
            loaded.append(sd)
            return types.SimpleNamespace(missing_keys=[], unexpected_keys=[])

    safe, s = _save(tmp_path, "moe")
    binary, _ = _save(tmp_path / "bin", "moe", safe=False)
    assert checkpoint_files(binary) is None
    rank = types.SimpleNamespace(
        shape=s, pipe=types.SimpleNamespace(stage=1), pp=2, tp_rank=0, tp=1, ep_rank=1, ep=2, te=False,
        dtype="float32", rank=3, chunks=[Module()], vp=1,
    )  # fmt: skip
    rank._shares = lambda: MegatronStrategy._shares(rank)
    rank._load_chunk = lambda *a: MegatronStrategy._load_chunk(rank, *a)
    with caplog.at_level(logging.INFO, logger="reroll.strategies.megatron"):
        for path in (safe, binary):
            MegatronStrategy._load_hf(rank, path)
    assert "has no safetensors files: rank 3 reads the whole model" in caplog.text
    assert "rank 3 read" in caplog.text
    assert len(loaded) == 2 and loaded[0]
    _assert_same(*loaded)


def test_a_path_that_is_no_checkpoint_is_a_user_error(tmp_path):
    from reroll.errors import UserError

    with pytest.raises(UserError, match=r"cannot read a checkpoint from model\.path"):
        checkpoint_files(tmp_path / "missing")
    assert checkpoint_files(tmp_path) is None  # a directory without safetensors files: the fallback


def test_a_checkpoint_with_fused_experts_reads_the_same(tmp_path):
    """Files holding transformers' fused ``mlp.experts.gate_up_proj``/``down_proj`` (not what
    ``save_pretrained`` writes, but a valid safetensors checkpoint of the state dict) give the same
    ranks as the per-expert files."""
    from safetensors.torch import save_file

    path, s = _save(tmp_path, "moe")
    full = load_causal_lm(path).state_dict()
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in full.items()}, str(fused / "model.safetensors"))
    files = checkpoint_files(fused)
    assert "model.layers.0.mlp.experts.gate_up_proj" in files  # the fused names are what is read
    for stage, _, ep_rank in _ranks(2, 1, 2):
        where = dict(stage=stage, pp=2, tp_rank=0, tp=1, ep_rank=ep_rank, ep=2)
        with CheckpointReader(files, torch.float32) as reader:
            ours = mc.rank_from_hf(reader, s, **where)
        _assert_same(ours, _today(full, s, *where.values(), False))


@pytest.mark.parametrize("name", ["qwen2_tied", "moe"])
def test_every_model_chunk_reads_its_layers_of_the_interleaved_split(tmp_path, name):
    """PP=2 x VPP=2 on 4 layers: each (stage, chunk) at TP 1/2 reads from the files what the whole model
    split gives (bit-equal), chunk c of stage p its layer c pp + p numbered from 0, the embedding on
    stage 0's chunk 0 only and the head on stage 1's chunk 1 only (a tied model's head the embedding's
    copy); and the chunks together hold every weight of the converted model once."""
    torch.manual_seed(0)
    four = {**COMMON, "num_hidden_layers": 4}
    config = {
        "qwen2_tied": lambda: Qwen2Config(**four, tie_word_embeddings=True),
        "moe": lambda: Qwen3MoeConfig(
            **four, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
        ),
    }[name]()
    model = AutoModelForCausalLM.from_config(config).float()
    path = tmp_path / name
    model.save_pretrained(path)
    s = mc.gpt_shape(config)
    full = load_causal_lm(path, "float32", "cpu").state_dict()
    files = checkpoint_files(path)
    whole = mc.hf_to_megatron(full, s, padded_vocab=s.padded_vocab(1))
    rebuilt: dict[str, torch.Tensor] = {}
    for tp in (1, 2):
        for stage in range(2):
            for chunk in range(2):
                for tp_rank in range(tp):
                    where = dict(stage=stage, pp=2, tp_rank=tp_rank, tp=tp, chunk=chunk, vp=2)
                    mega = mc.hf_to_megatron(full, s, padded_vocab=s.padded_vocab(tp))
                    theirs = mc.shard(mc.shard_stage(mega, s, stage, 2, chunk, 2), s, tp_rank, tp)
                    with CheckpointReader(files, DTYPES["float32"]) as reader:
                        ours = mc.rank_from_hf(reader, s, **where)
                    _assert_same(ours, theirs)
                    _assert_same(mc.rank_from_hf(full, s, **where), theirs)
                    assert ("embedding.word_embeddings.weight" in ours) == ((stage, chunk) == (0, 0))
                    assert ("output_layer.weight" in ours) == ((stage, chunk) == (1, 1))
                    assert ("decoder.final_layernorm.weight" in ours) == (stage == 1 and chunk == 1)
                    if tp > 1:
                        continue
                    (layer,) = mc.virtual_stage_layers(4, stage, 2, 2, chunk)
                    assert layer == chunk * 2 + stage
                    for k, w in ours.items():
                        if k == "output_layer.weight" and s.tied:
                            continue  # the tied copy of the embedding
                        g = k.replace("decoder.layers.0.", f"decoder.layers.{layer}.")
                        assert g not in rebuilt, g
                        rebuilt[g] = w
    _assert_same(rebuilt, whole)
