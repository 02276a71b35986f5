"""LoRA helpers: merged weights equal peft's own merge, and adapter names round-trip."""

from __future__ import annotations

import peft as _peft  # noqa: F401  (imported at collection: its first import takes seconds)
import pytest
import torch

from reroll.config.training import LoRAConfig
from reroll.strategies.lora import (
    adapter_names_to_model,
    adapter_names_to_saved,
    apply_lora,
    is_adapter_key,
    merged_state_dict,
    payload_bytes,
)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(6, 4)
        self.o_proj = torch.nn.Linear(4, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.q_proj(x))


def _wrapped(targets=("q_proj", "o_proj")):
    torch.manual_seed(0)
    base = _Block()
    peft = apply_lora(base, LoRAConfig(rank=2, alpha=6.0, target_modules=list(targets)), trainable=True)
    with torch.no_grad():  # B starts at 0 (no change); make the adapters do something
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return peft


def test_merge_equals_peft_merge_and_the_wrapped_forward():
    peft = _wrapped()
    merged = merged_state_dict(peft.state_dict(), scale=6.0 / 2)
    x = torch.randn(3, 6)
    expected = peft(x)
    reference = peft.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys() == {"q_proj.weight", "q_proj.bias", "o_proj.weight"}
    for k in reference:
        torch.testing.assert_close(merged[k], reference[k])
    plain = _Block()
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(x), expected)


def test_only_adapters_train_and_names_round_trip():
    peft = _wrapped(("q_proj",))
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert trainable == {
        "base_model.model.q_proj.lora_A.default.weight",
        "base_model.model.q_proj.lora_B.default.weight",
    }
    adapters = {k: v for k, v in peft.state_dict().items() if is_adapter_key(k)}
    saved = adapter_names_to_saved(adapters)
    assert set(saved) == {"base_model.model.q_proj.lora_A.weight", "base_model.model.q_proj.lora_B.weight"}
    assert adapter_names_to_model(saved).keys() == adapters.keys()
    # A (2, 6) + B (4, 2), float32: (12 + 8) * 4 bytes
    assert payload_bytes(saved) == 80


def test_unknown_target_module_names_the_layers_there_are():
    with pytest.raises(ValueError, match=r"no linear layer named \['v_proj'\].*\['o_proj', 'q_proj'\]"):
        apply_lora(_Block(), LoRAConfig(target_modules=["q_proj", "v_proj"]), trainable=True)


def test_merge_needs_both_halves():
    with pytest.raises(KeyError, match="lora_A and lora_B"):
        merged_state_dict(
            {
                "base_model.model.q_proj.base_layer.weight": torch.zeros(4, 6),
                "base_model.model.q_proj.lora_A.default.weight": torch.zeros(2, 6),
            },
            scale=1.0,
        )


def test_lora_with_kl_after_a_warm_start_is_a_config_problem(tmp_path):
    from reroll.config.schema import RunConfig

    def problems(**changes):
        raw = {
            "pipeline": "rlvr",
            "model": {"path": str(tmp_path)},
            "data": {"train_files": ["x.jsonl"]},
            "strategy": {"name": "fsdp2", "lora": {}},
            "algorithm": {"kl_coef": 0.1},
            "sft": {"steps": 5},
        }
        return [p.path for p in RunConfig.model_validate(raw | changes).check()]

    assert "strategy.lora" in problems()
    assert "strategy.lora" not in problems(sft=None)
    assert "strategy.lora" not in problems(algorithm={"kl_coef": 0.0})
