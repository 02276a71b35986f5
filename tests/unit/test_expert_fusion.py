"""``reroll.models.expert_fusion``: the per-expert tensors that make a fused expert's row, as transformers
fuses them on load (the fact ``shard_fill`` and ``megatron_convert.layer_parts`` both follow)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from reroll.models.expert_fusion import expert_row, row_sources


def test_a_fused_experts_row_is_its_named_tensors_concatenated_as_from_pretrained_holds_it(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=37, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=3, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    files, loaded = load_file(tmp_path / "model.safetensors"), AutoModelForCausalLM.from_pretrained(tmp_path)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert expert_row("qwen3_moe", fused, 2) == (
        "model.layers.0.mlp.experts.2.gate_proj.weight",
        "model.layers.0.mlp.experts.2.up_proj.weight",
    )
    for name in (fused, "model.layers.0.mlp.experts.down_proj"):
        held = loaded.get_parameter(name)
        if name not in files:  # transformers 5 fuses on load; 4 keeps one module per expert
            for e in range(3):
                assert torch.equal(held[e], torch.cat([files[n] for n in expert_row("qwen3_moe", name, e)]))
    with pytest.raises(KeyError, match="fuses no experts"):
        expert_row("qwen3_moe", "model.layers.0.mlp.gate.weight", 0)


def test_a_conversion_other_than_stacking_experts_has_no_row_sources():
    core = pytest.importorskip("transformers.core_model_loading")
    stack = core.WeightConverter("e.*.w", "e.w", operations=[core.MergeModulelist(dim=0)])
    transpose = core.WeightConverter("e.w", "e.w", operations=[core.Transpose(1, 2)])  # Qwen3-VL-MoE's
    assert row_sources(stack) == ("e.*.w",) and row_sources(transpose) is None
