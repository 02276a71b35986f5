"""The tiny mixture-of-experts model (model.build_tiny.moe)."""

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

from reroll.config.model import TinyModelConfig, TinyMoEConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.models.tiny import build_tiny_model, char_tokenizer


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    moe = TinyMoEConfig(experts=4, top_k=2)
    path = tmp_path_factory.mktemp("moe")
    return build_tiny_model(path, alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_heads=2, moe=moe)


def test_tiny_moe_is_a_qwen3_moe_that_reloads(moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    assert isinstance(model, Qwen3MoeForCausalLM)
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 128)
    assert c.head_dim == 32 and c.norm_topk_prob and not c.output_router_logits
    assert c.router_aux_loss_coef == 0.001 and c.mlp_only_layers == []
    # every layer's experts as one tensor each in memory (transformers 5), one per expert on disk
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 256, 64)
    tok, reloaded = char_tokenizer(ARITHMETIC_ALPHABET), AutoTokenizer.from_pretrained(moe_dir)
    assert reloaded("12+34=")["input_ids"] == tok("12+34=")["input_ids"]
    # rebuilt with the same seed: the same weights
    again = build_tiny_model(
        moe_dir.parent / "again",
        alphabet=ARITHMETIC_ALPHABET,
        hidden_size=64,
        num_heads=2,
        moe=TinyMoEConfig(),
    )
    other = AutoModelForCausalLM.from_pretrained(again)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_moe_section_is_range_checked():
    with pytest.raises(ValidationError, match=r"top_k \(5\) must be at most experts \(4\)"):
        TinyModelConfig(moe={"experts": 4, "top_k": 5})
    with pytest.raises(ValidationError, match="multiple of 32"):
        TinyMoEConfig(expert_hidden_size=48)
    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        TinyMoEConfig(experts=1)
    with pytest.raises(ValidationError, match="Extra inputs"):
        TinyModelConfig(moe={"experts": 4, "topk": 2})
