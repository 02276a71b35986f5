"""``model.fused_norm``: a model's plain RMSNorm layers run as torch's ``rms_norm`` and compute what
they computed before (the same in fp32, bf16 rounding apart in bf16); other norms keep their code."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.models.loading import fuse_rms_norms
from reroll.strategies.torch_strategy import TorchStrategy
from tests.conftest import write_config


def _model(layers: int = 2) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # norms of ones would hide a weight applied in the wrong place
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _fused(module: torch.nn.Module) -> bool:
    return "forward" in vars(module)


def test_same_outputs_and_gradients_in_fp32():
    plain = _model()
    fused = copy.deepcopy(plain)
    assert fuse_rms_norms(fused) == 2 * 2 + 1  # two per decoder layer and the final one
    ids = torch.randint(0, 97, (3, 9))
    a, b = fused(input_ids=ids).logits, plain(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert fused.state_dict().keys() == plain.state_dict().keys()


def test_bf16_differs_by_rounding_only():
    plain = _model().to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    fuse_rms_norms(fused)
    ids = torch.randint(0, 97, (3, 9))
    with torch.no_grad():
        a, b = fused(input_ids=ids).logits.float(), plain(input_ids=ids).logits.float()
    assert (a - b).abs().max() <= 0.02 * b.abs().max()


def test_a_copy_keeps_its_own_norms():
    fused = _model()
    fuse_rms_norms(fused)
    twin = copy.deepcopy(fused)
    with torch.no_grad():
        twin.model.norm.weight.fill_(2.0)
    assert twin.model.norm.forward.__self__ is twin.model.norm
    x = torch.randn(2, 32)
    assert not torch.allclose(twin.model.norm(x), fused.model.norm(x))


class BiasRMSNorm(torch.nn.Module):
    """Not a plain RMSNorm: a bias after the scale."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.bias = torch.nn.Parameter(torch.full((d,), 0.1))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) + self.bias
        )


@pytest.mark.parametrize("norm", [GemmaRMSNorm(16), BiasRMSNorm(16)], ids=["gemma", "bias"])
def test_other_norms_keep_their_code(norm):
    holder = torch.nn.Sequential(norm)
    assert fuse_rms_norms(holder) == 0 and not _fused(norm)


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("strategy", ["torch", "fsdp2"])
def test_strategy_follows_the_config(tmp_path, assets, on, strategy):
    from reroll.strategies.fsdp2 import FSDP2Strategy

    path = write_config(tmp_path / "c.yaml", assets, model={"fused_norm": on}, strategy={"name": strategy})
    cfg = load_config(path, RunConfig)
    s = {"torch": TorchStrategy, "fsdp2": FSDP2Strategy}[strategy](cfg.model.path, cfg=cfg)
    norms = [m for m in s.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(_fused(m) == on for m in norms)
