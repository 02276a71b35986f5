"""A checkpoint's ``model/`` written by several ranks, one decoder layer at a time (``hf_export``), holds
what ``save_pretrained`` writes: the same names (tied copies dropped, an MoE layer's fused experts split
back into one tensor per expert, as transformers reverts them), the same bytes, and loads with
``from_pretrained``. Ranks are simulated in turn in this process: a full copy's gather needs no
collective, so rank 0 and rank 1 each write their own files into one directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from reroll.strategies.hf_export import (
    HFNames,
    StreamGather,
    decoder_layers,
    distinct_state,
    layer_units,
    write_hf_model,
)


def _saved(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return out


def _export(model, directory, *, world_size: int, max_file_bytes: int = 2**40) -> list[list[str]]:
    """Every rank's part of the export, one rank after another; returns the units each gather asked for."""
    state = distinct_state(model)
    units = layer_units(model, state, decoder_layers(model))
    asked: list[list[str]] = []

    def gather(names, keep):
        asked.append(list(names))
        return {n: state[n].detach().clone() for n in names} if keep else {}

    for rank in range(world_size):
        write_hf_model(
            directory, HFNames(model), state, units, gather,
            rank=rank, world_size=world_size, max_file_bytes=max_file_bytes,
        )  # fmt: skip
    return asked


def _tiny_moe(path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)  # as a strategy loads it: conversions attached


def test_moe_experts_are_written_per_expert_as_save_pretrained_does(tmp_path):
    model = _tiny_moe(tmp_path / "moe")
    fused = [k for k in model.state_dict() if k.endswith("experts.gate_up_proj")]
    if not fused:
        pytest.skip("this transformers keeps one tensor per expert: nothing to revert")
    asked = _export(model, tmp_path / "out", world_size=2)

    def layer(i):
        return [n for n in model.state_dict() if n.startswith(f"model.layers.{i}.")]

    # a unit per decoder layer and one per module outside them, gathered in turn by each of the two ranks
    units = [["model.embed_tokens.weight"], layer(0), layer(1), ["model.norm.weight"], ["lm_head.weight"]]
    assert asked == units + units
    expected, written = _saved(tmp_path / "moe"), _saved(tmp_path / "out")
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in written
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(written)
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_tied_model_in_several_files_loads_with_from_pretrained(tmp_path, assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    assert model.config.tie_word_embeddings
    # files of at most 40 KB asked of a 535 KB model: one per unit (embeddings, 2 layers, norm), as no
    # unit is split; more files than the one rank, each written whole by it
    _export(model, tmp_path / "out", world_size=1, max_file_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) == 4 and files[0] == "model-00001-of-00004.safetensors"
    written = _saved(tmp_path / "out")
    assert "lm_head.weight" not in written  # the tied copy, which save_pretrained drops too
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]


def test_one_rank_small_model_is_one_file(tmp_path, assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    _export(model, tmp_path / "out", world_size=1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def _units_and_stream(model):
    """The model's export units, and its weights as Megatron's ``named_weights`` streams them: whole CPU
    copies one at a time, in order, the tied head's copy of the embedding last."""
    state = distinct_state(model)
    units = layer_units(model, state, decoder_layers(model))

    def stream():
        for name, value in model.state_dict().items():
            yield name, value.detach().clone()

    return state, units, stream


def test_a_stream_of_weights_is_written_holding_about_two_layers(tmp_path, assets):
    """Two simulated ranks, each reading the whole stream (as every Megatron rank does) and writing its
    own files; the directory loads with ``from_pretrained`` as the model, the index names every tensor's
    file, and neither the writer nor the stream's reader held more than a unit or two."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    state, units, stream = _units_and_stream(model)
    assert "lm_head.weight" in dict(stream()) and "lm_head.weight" not in state  # tied: streamed, not saved
    largest = max(sum(state[n].numel() * state[n].element_size() for n in unit) for unit in units)
    for rank in range(2):
        reader = StreamGather(stream(), units)
        held = write_hf_model(
            tmp_path / "out", HFNames(model), state, units, reader,
            rank=rank, world_size=2, max_file_bytes=100_000,
        )  # fmt: skip
        reader.finish()
        # the writer: the unit being written and the one gathered beside it; the reader: one unit, as the
        # stream comes in the units' order
        assert 0 < held <= 2 * largest and 0 < reader.peak_bytes <= largest
    written = _saved(tmp_path / "out")
    assert written.keys() == state.keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in written.values())
    for path in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            assert all(index["weight_map"][k] == path.name for k in f.keys())  # noqa: SIM118
    # 535 KB in files of at most 100 KB asks for 6, but no unit is split: one file per unit (4)
    assert len(set(index["weight_map"].values())) == len(units) == 4


def test_a_stream_that_ends_early_names_what_it_lacked(tmp_path, assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    state, units, stream = _units_and_stream(model)
    short = (item for item in stream() if item[0] != "model.norm.weight")
    with pytest.raises(RuntimeError, match=r"ended without \['model.norm.weight'\]"):
        write_hf_model(
            tmp_path, HFNames(model), state, units, StreamGather(short, units), rank=0, world_size=1
        )
