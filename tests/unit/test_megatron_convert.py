"""Hugging Face <-> Megatron-Core weights: exact round trips, TP split/merge, and (with megatron-core
installed) a CPU-built ``GPTModel`` that takes the converted weights and gives Hugging Face's logits."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from reroll.errors import UserError
from reroll.models import megatron_convert as mc

COMMON = dict(
    vocab_size=37,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
CONFIGS = {
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),  # qkv bias, tied
    "qwen3": lambda: Qwen3Config(
        **COMMON, head_dim=24, tie_word_embeddings=False
    ),  # q/k norm, head_dim != 16
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
}


def _hf(name: str) -> tuple[torch.nn.Module, mc.GPTShape]:
    torch.manual_seed(0)
    config = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, so a swapped norm shows
            p.normal_(0, 0.1)
    return model, mc.gpt_shape(config)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_is_exact(name, fused_norms):
    model, shape = _hf(name)
    hf = model.state_dict()
    megatron = mc.hf_to_megatron(hf, shape, fused_norms=fused_norms, padded_vocab=40)
    assert megatron["embedding.word_embeddings.weight"].shape == (40, 64)
    assert ("output_layer.weight" in megatron) == (not shape.tied)
    norm = "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert (norm in megatron) == fused_norms
    back = mc.megatron_to_hf(megatron, shape)
    assert back.keys() == hf.keys()
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def test_qkv_is_grouped_per_query_group():
    model, s = _hf("llama")  # 4 query heads in 2 groups: [q0 q1 k0 v0 | q2 q3 k1 v1], 16 rows each
    hf = model.state_dict()
    qkv = mc.hf_to_megatron(hf, s)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    d = s.head_dim
    assert qkv.shape == ((4 + 2 * 2) * d, 64)
    assert torch.equal(qkv[: 2 * d], q[: 2 * d])
    assert torch.equal(qkv[2 * d : 3 * d], k[:d])
    assert torch.equal(qkv[3 * d : 4 * d], v[:d])
    assert torch.equal(qkv[4 * d : 6 * d], q[2 * d :])
    assert torch.equal(qkv[7 * d :], v[d:])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_split_and_merge_are_exact(name):
    model, s = _hf(name)
    full = mc.hf_to_megatron(model.state_dict(), s, padded_vocab=s.padded_vocab(2))
    shards = [mc.shard(full, s, r, 2) for r in range(2)]
    d = s.head_dim
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[1][qkv].shape == ((2 + 2) * d, 64)  # one group: 2 query heads, k, v
    assert torch.equal(shards[1][qkv], full[qkv][4 * d :])
    gate, up = full["decoder.layers.0.mlp.linear_fc1.weight"].chunk(2)
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[48:], up[48:]]))
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert torch.equal(shards[0][proj], full[proj][:, : 2 * d])
    assert shards[0]["embedding.word_embeddings.weight"].shape == (19, 64)  # 37 padded to 38, halved
    merged = mc.merge(shards)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[k], full[k]) for k in full)
    back = mc.megatron_to_hf(merged, s)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_pipeline_stages_split_and_merge_are_exact(name, pp):
    """Stage p holds its run of layers numbered from 0 (6 layers over 4 stages: 1, 2, 2, 1), the embedding on the first stage, the final norm
    and output layer on the last (a tied model's last stage a copy of the embedding); with TP shards
    inside each stage, every stage's shards merged and the stages merged give the checkpoint back."""
    torch.manual_seed(0)
    fields = CONFIGS[name]().to_dict() | {"num_hidden_layers": 6}
    fields.pop("layer_types", None)  # per layer: rebuilt for 6
    config = type(CONFIGS[name]())(**fields)
    model = AutoModelForCausalLM.from_config(config).float()
    s = mc.gpt_shape(config)
    full = mc.hf_to_megatron(model.state_dict(), s, padded_vocab=s.padded_vocab(2))
    stages = [mc.shard_stage(full, s, p, pp) for p in range(pp)]
    per = 6 // pp if pp < 4 else 1  # the first and last stage's layers
    last = stages[-1]
    assert [len({k.split(".")[2] for k in st if k.startswith("decoder.layers.")}) for st in stages] == (
        [per] * pp if pp < 4 else [1, 2, 2, 1]
    )
    assert torch.equal(
        last["decoder.layers.0.mlp.linear_fc2.weight"],
        full[f"decoder.layers.{6 - per}.mlp.linear_fc2.weight"],
    )
    assert f"decoder.layers.{per}.mlp.linear_fc2.weight" not in stages[0]
    assert "embedding.word_embeddings.weight" in stages[0] and "embedding.word_embeddings.weight" not in last
    assert "decoder.final_layernorm.weight" in last and "decoder.final_layernorm.weight" not in stages[0]
    assert torch.equal(
        last["output_layer.weight"],
        full["output_layer.weight" if not s.tied else "embedding.word_embeddings.weight"],
    )
    sharded = [[mc.shard(st, s, r, 2) for r in range(2)] for st in stages]
    merged = mc.merge_stages([mc.merge(tp) for tp in sharded], s)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[k], full[k]) for k in full)
    back = mc.megatron_to_hf(merged, s)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    with pytest.raises(
        UserError, match=r"pipeline_parallel \(5\) leaves a pipeline stage no layer of the model's 6"
    ):
        mc.shard_stage(full, s, 0, 5)


def test_pipeline_stage_sizes_split_as_megatron_core_does():
    """Even where the stages divide the layers; else the middle stages ceil(L / pp) each and the first and
    last the rest (Megatron-Core's num_layers_in_first/last_pipeline_stage); Qwen3-235B-A22B's 94 layers
    over 4 and 8 stages."""
    from reroll.config.startable import pipeline_stage_sizes

    assert pipeline_stage_sizes(28, 4) == [7, 7, 7, 7]
    assert pipeline_stage_sizes(94, 4) == [23, 24, 24, 23]
    assert pipeline_stage_sizes(94, 8) == [11] + [12] * 6 + [11]
    assert pipeline_stage_sizes(5, 2) == [2, 3]
    assert pipeline_stage_sizes(5, 4) == []  # the first stage would hold none
    assert mc.pipeline_config(28, 4) == {}
    assert mc.pipeline_config(94, 4) == {
        "num_layers_in_first_pipeline_stage": 23,
        "num_layers_in_last_pipeline_stage": 23,
    }


def test_virtual_stage_layers_are_megatron_cores_interleaved_assignment():
    """Chunk c of stage p holds the (c pp + p)-th run of L / (pp vp) layers: PP=2 x VPP=2 on 4 layers
    puts layers 0 and 2 on stage 0, 1 and 3 on stage 1; each chunk's start and length equal
    Megatron-Core's own ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` at
    ``virtual_pipeline_model_parallel_size``, and every layer is held exactly once."""
    assert [mc.virtual_stage_layers(4, p, 2, 2, c) for c in range(2) for p in range(2)] == [
        range(0, 1),
        range(1, 2),
        range(2, 3),
        range(3, 4),
    ]
    assert mc.virtual_stage_layers(6, 1, 2, 1, 0) == mc.stage_layers(6, 1, 2)  # vp = 1: no chunks
    # (stage, chunk, index there) of each layer: the inverse, also of an uneven split without chunks
    assert [mc.layer_owner(4, i, 2, 2) for i in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [mc.layer_owner(5, i, 2) for i in range(5)] == [
        (0, 0, 0),
        (0, 0, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 0, 2),
    ]
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for layers, pp, vp in ((4, 2, 2), (8, 2, 2), (12, 2, 3), (24, 4, 2), (48, 4, 3)):
        config = types.SimpleNamespace(
            num_layers=layers,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            pipeline_model_parallel_layout=None,
            num_layers_in_first_pipeline_stage=None,
            num_layers_in_last_pipeline_stage=None,
            account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False,
            mtp_num_layers=None,
        )
        held = []
        for p in range(pp):
            for c in range(vp):
                r = mc.virtual_stage_layers(layers, p, pp, vp, c)
                assert r.start == get_transformer_layer_offset(config, vp_stage=c, pp_rank=p)
                assert len(r) == get_num_layers_to_build(config, vp_stage=c, pp_rank=p)
                held += r
        assert sorted(held) == list(range(layers))


def test_virtual_pipeline_sizes_are_user_errors():
    """pp x vp must divide the layers (the fix lists the vp that do; a mixture of experts' too), vp > 1
    needs pp > 1 and no context parallelism: each refused with the fix, by the checks the strategy and
    ``reroll validate`` run."""
    from reroll.config.startable import megatron_moe_problems, virtual_pipeline_problems
    from reroll.config.training import MegatronConfig
    from reroll.strategies.megatron import check_parallel_sizes

    assert virtual_pipeline_problems(4, 2, 2) == []
    assert virtual_pipeline_problems(6, 2, 1) == []
    (msg,) = virtual_pipeline_problems(6, 2, 2)
    assert "pipeline_parallel (2) x virtual_pipeline (2) = 4 must divide the model's 6 layers" in msg
    assert "use a virtual_pipeline of [1, 3]" in msg
    (msg,) = virtual_pipeline_problems(4, 1, 2)
    assert "needs pipeline_parallel > 1" in msg
    with pytest.raises(UserError, match=r"= 4 must divide the model's 6 layers"):
        mc.virtual_stage_layers(6, 0, 2, 2, 0)
    assert check_parallel_sizes(4, MegatronConfig(pipeline_parallel=2, virtual_pipeline=2)) == 2
    with pytest.raises(UserError, match=r"virtual_pipeline \(2\) needs pipeline_parallel > 1"):
        check_parallel_sizes(4, MegatronConfig(virtual_pipeline=2))
    assert check_parallel_sizes(8, MegatronConfig(pipeline_parallel=2, virtual_pipeline=2), 2) == 2
    vpp = MegatronConfig(pipeline_parallel=2, virtual_pipeline=2)
    dense = types.SimpleNamespace(model_type="qwen3", num_hidden_layers=6)
    assert ["= 4 must divide the model's 6 layers" in m for m in megatron_moe_problems(dense, vpp)] == [True]
    moe = types.SimpleNamespace(model_type="qwen3_moe", num_hidden_layers=4, num_experts=4)
    assert megatron_moe_problems(moe, vpp) == []  # its routers pool every chunk (``ScheduledRouting``)
    odd = types.SimpleNamespace(model_type="qwen3_moe", num_hidden_layers=6, num_experts=4)
    assert ["= 4 must divide the model's 6 layers" in m for m in megatron_moe_problems(odd, vpp)] == [True]


def test_router_counts_join_in_the_models_layer_order():
    """``ScheduledRouting`` joins each (stage, model chunk)'s top-k counts of a micro-batch in the order
    ``layer_runs`` gives: the runs of ``virtual_stage_layers`` in the model's order, so the joined
    ``(L, E)`` counts (the experts' load per layer) are every layer's once, where the plain pipeline
    puts them, whatever the layout. At PP=2 x VPP=2 over 4 layers: stage 0's chunk 0 (layer 0), stage
    1's chunk 0 (1), stage 0's chunk 1 (2), stage 1's chunk 1 (3); at VPP=1 the stages in order (an
    uneven split too)."""
    from reroll.strategies.megatron_moe import layer_runs

    assert layer_runs(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert layer_runs(5, 2) == [(0, 0), (1, 0)]
    for layers, pp, vp in ((4, 2, 2), (8, 2, 2), (12, 3, 2), (8, 2, 4), (24, 4, 3), (5, 2, 1), (6, 3, 1)):
        runs = layer_runs(layers, pp, vp)
        assert sorted(runs) == [(p, c) for p in range(pp) for c in range(vp)]  # each chunk once
        joined = [i for p, c in runs for i in mc.virtual_stage_layers(layers, p, pp, vp, c)]
        assert joined == list(range(layers)), (layers, pp, vp)


def test_the_interleaved_schedule_takes_any_count_of_micro_batches():
    """Megatron-Core's interleaved schedule runs each chunk's micro-batches in groups (at least pp, and a
    last group of none or at least pp): the smallest group that fits the count, which is pp where pp
    divides it; fewer than pp micro-batches get empty fillers."""
    from reroll.strategies.megatron_pipeline import fillers, interleaved_group

    assert [interleaved_group(m, 2) for m in range(2, 9)] == [2, 3, 2, 3, 2, 4, 2]
    assert [interleaved_group(m, 3) for m in (3, 4, 5, 6, 7, 8)] == [3, 4, 5, 3, 4, 4]
    for m in range(2, 30):  # a valid group: Megatron-Core's two conditions
        g = interleaved_group(m, 2)
        assert 2 <= g <= m and (m % g == 0 or m % g >= 2)
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        interleaved_group(1, 2)
    assert (fillers(1, 2, 2), fillers(1, 4, 2), fillers(2, 2, 2), fillers(1, 2, 1)) == (1, 3, 0, 0)


def test_each_stage_knows_the_micro_batch_of_every_tensor_it_receives():
    """PP=2 x VPP=2, 4 micro-batches in groups of 2: the schedule's forward steps are (micro-batch,
    chunk) (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1) on both stages, its backward steps the same
    with the chunks reversed. Stage 0 receives activations for its chunk 1 only (stage 1's chunk-0
    outputs: 0 1 2 3) and a gradient from every backward step of stage 1 (each of its chunks has a
    chunk before it on stage 0); stage 1 receives every activation, and gradients only from stage 0's
    chunk 1 (stage 0's chunk 0 has nothing before it to send to)."""
    from reroll.strategies.megatron_pipeline import received_micro_batches

    table = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert received_micro_batches(table, 0, 2, 2) == ([0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 2, 3])
    assert received_micro_batches(table, 1, 2, 2) == ([0, 1, 0, 1, 2, 3, 2, 3], [0, 1, 2, 3])
    pytest.importorskip("megatron.core")
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    assert get_schedule_table(4, 2, 2) == table  # the order Megatron-Core's schedule takes
    # four stages: a middle stage receives every tensor both ways; each stage receives as many
    # activations as its predecessor sends (all but the last stage's last chunk's)
    table = get_schedule_table(5, 2, 5)
    middle = received_micro_batches(table, 1, 4, 2)
    assert middle == ([mb for mb, _ in table], [mb for mb, _ in table])
    assert len(received_micro_batches(table, 0, 4, 2)[0]) == 5


def test_unsupported_models_and_sizes_are_user_errors():
    with pytest.raises(UserError, match=r"'gpt2' model: use strategy\.name=fsdp2"):
        mc.gpt_shape(GPT2Config())
    _, s = _hf("qwen2")
    with pytest.raises(
        UserError, match=r"tensor_parallel \(4\) must divide the model's num_key_value_heads \(2\)"
    ):
        mc.shard({}, s, 0, 4)


def test_parallel_sizes_are_checked():
    from reroll.config.training import MegatronConfig
    from reroll.strategies.megatron import check_parallel_sizes

    assert check_parallel_sizes(8, MegatronConfig(tensor_parallel=2)) == 4
    with pytest.raises(UserError, match=r"world_size \(6\) must be divisible by .* = 4"):
        check_parallel_sizes(6, MegatronConfig(tensor_parallel=4))
    assert check_parallel_sizes(8, MegatronConfig(tensor_parallel=2, pipeline_parallel=2)) == 2
    with pytest.raises(UserError, match=r"world_size \(6\) must be divisible by .* = 4"):
        check_parallel_sizes(6, MegatronConfig(pipeline_parallel=4))
    # context-parallel groups lie inside the data-parallel ranks: the role's size, not the config's
    assert check_parallel_sizes(8, MegatronConfig(tensor_parallel=2, context_parallel=2), 2) == 2
    assert check_parallel_sizes(8, MegatronConfig(tensor_parallel=2, context_parallel=2)) == 4


@pytest.fixture(scope="module")
def megatron_one_rank():
    """megatron-core's process groups over one gloo rank (what building a GPTModel needs)."""
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed (pip install 'reroll[megatron]')"
    )
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()


def _gpt_model(s: mc.GPTShape):
    """A GPTModel of the strategy's local spec (``megatron_spec.local_block_spec``)."""
    from megatron.core.models.gpt import GPTModel

    from reroll.strategies.megatron_spec import local_block_spec

    config = mc.transformer_config(s, use_cpu_initialization=True)
    spec = local_block_spec(config, num_experts=s.num_experts, qk_norm=s.qk_norm)
    return GPTModel(config, spec, **mc.gpt_model_kwargs(s, 1))


def test_the_local_spec_norms_take_sequence_shards_and_mark_their_weights(megatron_one_rank):
    """Every norm of the strategy's local spec (each layer's two, Qwen3's q/k norms, the final one) is a
    ``SequenceParallelRMSNorm``: torch's RMSNorm, whose weight is marked ``sequence_parallel`` (so
    ``finalize_model_grads`` sums its gradient over the TP ranks) where the config is, and which gives
    each token the output it gets in the whole sequence (bit-equal: one kernel, per token). The
    Megatron-Core check it stands in for asserts at construction, so a config with
    ``sequence_parallel`` on is built here (TP 1 refuses it; only the norm reads the flag)."""
    from reroll.strategies.megatron_spec import SequenceParallelRMSNorm

    _, s = _hf("qwen3")
    gpt = _gpt_model(s)
    norms = [n for n, m in gpt.named_modules() if isinstance(m, torch.nn.RMSNorm)]
    assert len(norms) == 2 * 4 + 1  # input, pre-MLP, q and k norms of 2 layers, the final norm
    assert all(isinstance(gpt.get_submodule(n), SequenceParallelRMSNorm) for n in norms)
    assert not any(getattr(p, "sequence_parallel", False) for p in gpt.parameters())  # SP off here

    config = types.SimpleNamespace(normalization="RMSNorm", sequence_parallel=True)
    norm = SequenceParallelRMSNorm(config, hidden_size=16, eps=1e-6)
    assert norm.weight.sequence_parallel is True
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(6, 2, 16)  # [s, b, h]
    torch.testing.assert_close(norm(x)[2:4], norm(x[2:4]), atol=0, rtol=0)
    with pytest.raises(ValueError, match="not a LayerNorm"):
        SequenceParallelRMSNorm(types.SimpleNamespace(normalization="LayerNorm"), hidden_size=16)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_converted_weights_load_strictly_and_give_hf_logits(name, megatron_one_rank, monkeypatch):
    """The GPTModel's own keys and shapes are the converted ones (strict load); its logits equal
    Hugging Face's. Megatron-Core's forward asks for a CUDA device and RNG tracker even with dropout 0;
    on CPU both are pointed at the CPU for this test only."""
    from megatron.core import tensor_parallel

    model, s = _hf(name)
    gpt = _gpt_model(s)
    converted = mc.hf_to_megatron(model.state_dict(), s)
    extra = {k: v for k, v in gpt.state_dict().items() if k.endswith("_extra_state")}
    assert {k: v.shape for k, v in converted.items()} == {
        k: v.shape for k, v in gpt.state_dict().items() if k not in extra
    }
    gpt.load_state_dict(converted | extra, strict=True)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    no_fork = types.SimpleNamespace(fork=contextlib.nullcontext)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: no_fork)
    ids = torch.randint(0, s.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    causal = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        ours = gpt(ids, torch.arange(10).expand(2, 10), causal)
        theirs = model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)  # measured: <= 2e-7


def _moe(experts: int = 4, norm_topk_prob: bool = True, tied: bool = False):
    """A tiny Qwen3-MoE (every layer sparse, top-2) with weights away from their init."""
    from transformers import Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=37, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=experts, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model, mc.gpt_shape(config)


def test_moe_round_trip_is_exact_and_names_each_expert():
    model, s = _moe()
    assert (s.num_experts, s.moe_top_k, s.moe_ffn_hidden_size, s.qk_norm) == (4, 2, 16, True)
    hf = model.state_dict()
    megatron = mc.hf_to_megatron(hf, s)
    p = "decoder.layers.1.mlp."
    assert torch.equal(megatron[p + "router.weight"], hf["model.layers.1.mlp.gate.weight"])
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]  # (E, 2I, H): gate rows, then up
    assert megatron[p + "experts.local_experts.3.linear_fc1.weight"].shape == (32, 32)
    assert torch.equal(megatron[p + "experts.local_experts.3.linear_fc1.weight"], gate_up[3])
    assert torch.equal(
        megatron[p + "experts.local_experts.2.linear_fc2.weight"],
        hf["model.layers.1.mlp.experts.down_proj"][2],
    )
    assert not any("linear_fc1" in k and "experts" not in k for k in megatron)  # no dense MLP
    back = mc.megatron_to_hf(megatron, s)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())


@pytest.mark.parametrize(("ep", "tp"), [(2, 1), (4, 1), (2, 2)])
def test_moe_expert_and_tensor_shards_merge_back_exactly(ep, tp):
    """EP rank r holds experts r*E/ep.. numbered from 0; TP splits each expert as the dense MLP; merging
    the TP shards, then the EP shards, gives the unsharded dict back."""
    model, s = _moe()
    full = mc.hf_to_megatron(model.state_dict(), s, padded_vocab=s.padded_vocab(tp))
    per_ep = [mc.shard_experts(full, s, r, ep) for r in range(ep)]
    expert = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    for r, part in enumerate(per_ep):
        assert {k for k in part if "local_experts" in k and k.startswith("decoder.layers.0.")} == {
            f"decoder.layers.0.mlp.experts.local_experts.{i}.linear_fc{n}.weight"
            for i in range(4 // ep)
            for n in (1, 2)
        }
        assert torch.equal(part[expert.format(0)], full[expert.format(r * 4 // ep)])
    tp_shards = [[mc.shard(part, s, t, tp) for t in range(tp)] for part in per_ep]
    fc1 = tp_shards[0][0][expert.format(0)]
    assert fc1.shape == (2 * 16 // tp, 32)  # [gate_t; up_t] of expert 0
    assert tp_shards[0][0]["decoder.layers.0.mlp.router.weight"].shape == (4, 32)  # replicated
    merged = mc.merge_experts([mc.merge(ranks) for ranks in tp_shards])
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], v) for k, v in full.items())


def test_moe_sizes_are_checked():
    _, s = _moe(experts=6)
    with pytest.raises(UserError, match=r"expert_parallel \(4\) must divide the model's num_experts \(6\)"):
        mc.shard_experts({}, s, 0, 4)


def test_moe_converted_weights_load_strictly_and_give_hf_logits(megatron_one_rank, monkeypatch):
    """A CPU-built Megatron-Core MoE GPTModel (local spec, SequentialMLP experts, all-gather dispatcher)
    takes the converted weights strictly and gives Hugging Face's logits, for both routings
    (``norm_topk_prob`` on: softmax over the top k; off: top k of the softmax over all experts); the
    router logits MegatronRouters records give the load-balancing loss of Hugging Face's logits."""
    from megatron.core import tensor_parallel

    from reroll.algorithms.router import load_balance_loss
    from reroll.strategies.megatron_moe import MegatronRouters, allow_routers_without_transformer_engine

    allow_routers_without_transformer_engine()  # what MegatronStrategy does before building a MoE
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    no_fork = types.SimpleNamespace(fork=contextlib.nullcontext)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: no_fork)
    for norm_topk_prob in (True, False):
        model, s = _moe(norm_topk_prob=norm_topk_prob)
        gpt = _gpt_model(s)
        converted = mc.hf_to_megatron(model.state_dict(), s)
        extra = {k: v for k, v in gpt.state_dict().items() if k.endswith("_extra_state")}
        assert {k: v.shape for k, v in converted.items()} == {
            k: v.shape for k, v in gpt.state_dict().items() if k not in extra
        }
        gpt.load_state_dict(converted | extra, strict=True)

        ids = torch.randint(0, s.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 10, dtype=torch.long)
        mask[1, 6:] = 0
        causal = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)[None, None]
        routers = MegatronRouters(gpt, s, model.config)
        assert len(routers.modules) == 2
        with torch.no_grad(), routers.capture() as routed:
            routers.start_forward(mask)
            ours = gpt(ids, torch.arange(10).expand(2, 10), causal)
        with torch.no_grad():
            out = model(input_ids=ids, output_router_logits=True)
        torch.testing.assert_close(ours, out.logits, atol=1e-5, rtol=0)
        aux, counts = routed.loss(2)
        theirs = torch.stack(out.router_logits)  # (L, B*T, E), batch-major
        expected, expected_counts = load_balance_loss(theirs, mask.reshape(-1).bool(), top_k=2)
        torch.testing.assert_close(aux, expected)
        assert torch.equal(counts, expected_counts)
        assert not hasattr(routers.modules[0], "gating") or "gating" not in vars(routers.modules[0])
