"""What LoRA on the Megatron strategy takes, decided by the config alone
(``reroll.config.startable.megatron_lora_problems``): ``validate`` and ``plan`` say it before any rank
starts."""

from __future__ import annotations

from reroll.config.startable import megatron_lora_problems, megatron_targets
from tests.conftest import small_config

MEGATRON = ("strategy.name=megatron",)


def test_fused_layers_are_adapted_whole_and_unknown_names_are_named():
    assert megatron_targets(["q_proj", "k_proj", "v_proj", "o_proj"]) == ({"linear_qkv", "linear_proj"}, None)
    problem = megatron_targets(["q_proj", "v_proj", "down_proj"])[1]
    assert "k_proj + q_proj + v_proj as one layer (linear_qkv)" in problem and "add ['k_proj']" in problem
    assert "leave out ['q_proj', 'v_proj']" in problem
    assert "['lm_head'] are not layers" in megatron_targets(["lm_head"])[1]


def test_the_default_lora_on_megatron_is_accepted(tmp_path):
    cfg = small_config(tmp_path, "strategy.name=megatron", "strategy.lora.rank=8")
    assert megatron_lora_problems(cfg) == [] and cfg.strategy.synced_adapters is cfg.strategy.lora


def test_what_the_adapters_cannot_sit_beside_is_refused_with_the_fix(tmp_path):
    cfg = small_config(
        tmp_path,
        *MEGATRON,
        "strategy.lora.dropout=0.1",
        "strategy.lora.target_modules=[q_proj]",
        "strategy.megatron.transformer_engine=on",
        "strategy.megatron.distributed_optimizer=true",
    )
    found = dict(megatron_lora_problems(cfg))
    assert sorted(found) == [
        "strategy.lora.dropout",
        "strategy.lora.target_modules",
        "strategy.megatron.distributed_optimizer",
        "strategy.megatron.transformer_engine",
    ]
    assert "set it to 0" in found["strategy.lora.dropout"]
    assert "auto or off" in found["strategy.megatron.transformer_engine"]
    # distributed_optimizer is on by default: only a value set on purpose is refused (the adapters'
    # optimizer state stays whole, being small)
    assert megatron_lora_problems(small_config(tmp_path, *MEGATRON, "strategy.lora.rank=8")) == []


def test_a_bare_on_or_off_is_the_word_not_yaml_s_boolean(tmp_path):
    """``transformer_engine=on`` (YAML 1.1 reads a bare on as true) is the choice 'on'."""
    on = small_config(tmp_path, "strategy.megatron.transformer_engine=on")
    off = small_config(tmp_path, "strategy.megatron.transformer_engine=off")
    assert (on.strategy.megatron.transformer_engine, off.strategy.megatron.transformer_engine) == (
        "on",
        "off",
    )
