"""``reroll.strategies.shard_fill`` in one process: where each parameter of a meta-device model comes from
(the MoE's fused experts, the vision-language model's renamed tensors), and a shard's rows as
``from_pretrained`` holds them. Two ranks over gloo, through ``FSDP2Strategy``:
``tests/integration/test_fsdp2_load.py``."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from reroll.config.model import TinyMoEConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.models.checkpoint_reader import CheckpointReader, checkpoint_files
from reroll.models.loading import load_causal_lm, load_value_model
from reroll.models.tiny import build_tiny_model
from reroll.strategies.fsdp2 import _LOADERS, _start_model
from reroll.strategies.shard_fill import plan, write_rows


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    shape = dict(alphabet=ARITHMETIC_ALPHABET, hidden_size=32, num_layers=1, num_heads=1)
    return build_tiny_model(path, **shape, moe=TinyMoEConfig(experts=3, top_k=2), for_cpu_engine=False)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from reroll.models.tiny_vision import build_tiny_vl_model

    return build_tiny_vl_model(tmp_path_factory.mktemp("vl"), alphabet=ARITHMETIC_ALPHABET)


def test_fused_experts_come_from_the_per_expert_tensors_and_rows_equal_from_pretrained(moe):
    model = load_causal_lm(moe, "float32", "meta")
    with CheckpointReader(checkpoint_files(moe), torch.float32) as reader:
        targets, unplaced = plan(model, reader, zero_missing=False)
        assert unplaced == []
        by_name = {t.name: t for t in targets}
        assert "lm_head.weight" not in by_name  # tied: the embedding's tensor, filled once
        gate_up = by_name["model.layers.0.mlp.experts.gate_up_proj"].source
        assert gate_up.whole_rows and gate_up.rows[2] == (
            "model.layers.0.mlp.experts.2.gate_proj.weight",
            "model.layers.0.mlp.experts.2.up_proj.weight",
        )
        _second_rank_rows_equal_from_pretrained(moe, targets, reader)


def test_a_vision_language_model_reads_its_renamed_tensors_by_rows(vl):
    """transformers holds the files' ``visual.*`` and ``model.*`` as ``model.visual.*`` and
    ``model.language_model.*``: each is read under its name in the files, by rows."""
    model = load_causal_lm(vl, "float32", "meta")
    with CheckpointReader(checkpoint_files(vl), torch.float32) as reader:
        targets, unplaced = plan(model, reader, zero_missing=False)
        assert unplaced == []
        by_name = {t.name: t.source.rows for t in targets}
        assert by_name["model.visual.blocks.0.attn.qkv.weight"] == (("visual.blocks.0.attn.qkv.weight",),)
        assert by_name["model.language_model.norm.weight"] == (("model.norm.weight",),)
        assert {n for n, p in model.named_parameters() if p.is_meta} == set(by_name)  # every one planned
        assert len(by_name) == len(reader)  # each file tensor feeds one (the head is the tied embedding)
        _second_rank_rows_equal_from_pretrained(vl, targets, reader)
    # saving reverts what was followed as after from_pretrained: the same names (the files' own)
    from transformers.core_model_loading import revert_weight_conversion

    whole = load_causal_lm(vl)
    saved = revert_weight_conversion(whole, whole.state_dict())
    assert set(revert_weight_conversion(model, model.state_dict())) == set(saved)
    assert set(load_file(vl / "model.safetensors")) <= set(saved)  # (and the tied head's name)


def test_a_qwen2_vl_with_its_own_head_reads_its_renamed_tensors_by_rows(tmp_path):
    """Qwen2-VL (the family's first: another vision tower, an untied head) follows the same rules."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, eos_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]})  # fmt: skip
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=4, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(tmp_path)
    model = load_causal_lm(tmp_path, "float32", "meta")
    with CheckpointReader(checkpoint_files(tmp_path), torch.float32) as reader:
        targets, unplaced = plan(model, reader, zero_missing=False)
        assert unplaced == [] and len(targets) == len(reader)  # the head is its own tensor
        assert "model.visual.blocks.0.attn.qkv.weight" in {t.name for t in targets}
        _second_rank_rows_equal_from_pretrained(tmp_path, targets, reader)


def _second_rank_rows_equal_from_pretrained(path, targets, reader) -> None:
    """Rows 1 and on of every planned parameter, as a second rank of two holds them where dim 0 has
    three rows (ceil(3 / 2) = 2: one row), equal ``from_pretrained``'s and read alone."""
    whole = load_causal_lm(path)
    for t in targets:
        want = whole.get_parameter(t.name)[1:]
        local = torch.full_like(want, float("nan"))
        before = reader.read_bytes
        write_rows(reader, t.source, 1, local)
        assert torch.equal(local, want), t.name
        assert reader.read_bytes - before == want.numel() * 4, t.name  # its rows alone (float32 files)


def test_a_critic_head_the_checkpoint_lacks_starts_at_zero(moe):
    model = load_value_model(moe, "float32", "meta")
    with CheckpointReader(checkpoint_files(moe), torch.float32) as reader:
        targets, unplaced = plan(model, reader, zero_missing=True)
        assert unplaced == [] and "score.weight" in {t.name for t in targets}
        (score,) = [t for t in targets if t.name == "score.weight"]
        local = torch.ones(score.module.weight.shape)
        write_rows(reader, score.source, 0, local)
        assert not local.any()
        assert "score.weight" in plan(model, reader, zero_missing=False)[1]  # a policy's: not placed


def test_a_checkpoint_the_plan_cannot_place_is_loaded_whole_and_says_so(tmp_path, moe, caplog):
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in moe.iterdir():
        if f.suffix != ".safetensors":
            (renamed / f.name).write_bytes(f.read_bytes())
    tensors = load_file(moe / "model.safetensors")
    tensors["model.norm.scale"] = tensors.pop("model.norm.weight")  # a name the model does not have
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="reroll.strategies.fsdp2"):
        model, unfilled = _start_model(_LOADERS["causal_lm"], str(renamed), "float32", zero_missing=False)
    assert unfilled is None and not model.model.norm.weight.is_meta
    assert "model.norm.weight" in caplog.text and "loads the whole model on the host" in caplog.text

    (renamed / "model.safetensors").unlink()
    torch.save(load_file(moe / "model.safetensors"), renamed / "pytorch_model.bin")  # a .bin checkpoint
    with caplog.at_level(logging.INFO, logger="reroll.strategies.fsdp2"):
        model, unfilled = _start_model(_LOADERS["causal_lm"], str(renamed), "float32", zero_missing=False)
    assert unfilled is None and "has no safetensors files" in caplog.text
    assert torch.equal(model.lm_head.weight, load_causal_lm(moe).lm_head.weight)


def test_a_conversion_the_plan_does_not_follow_loads_the_model_whole_and_says_why(vl, caplog, monkeypatch):
    """A conversion a ``Source`` cannot describe (here a transpose, as Qwen3-VL-MoE's experts take) on
    top of the model's own: every rank loads the whole model, and the log names the conversion."""
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    own = mapping.get_model_conversion_mapping
    down = WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", operations=[Transpose(0, 1)])
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda model: [*own(model), down])
    with caplog.at_level(logging.INFO, logger="reroll.strategies.fsdp2"):
        model, unfilled = _start_model(_LOADERS["causal_lm"], str(vl), "float32", zero_missing=False)
    assert unfilled is None and not any(p.is_meta for p in model.parameters())
    assert "transformers converts ['mlp.down_proj.weight']" in caplog.text
    assert "loads the whole model on the host" in caplog.text
