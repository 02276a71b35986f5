"""``model.fused_norm`` on a GPU: torch's ``rms_norm`` gives the model's results to bf16 rounding and
keeps fewer activations for the backward pass than the model's own RMSNorm code."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from reroll.models.loading import fuse_rms_norms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _peak_gib(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Peak memory of a training pass (forward and backward), its logits and the final norm's gradient."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30, logits.detach().float(), model.model.norm.weight.grad


def test_fused_norm_matches_and_keeps_less():
    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=896,
        num_hidden_layers=4,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
    )
    torch.manual_seed(0)
    plain = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)
    fused = copy.deepcopy(plain)
    assert fuse_rms_norms(fused) == 2 * 4 + 1
    ids = torch.randint(0, 512, (16, 384), device="cuda")
    plain_peak, plain_logits, plain_grad = _peak_gib(plain, ids)
    fused_peak, fused_logits, fused_grad = _peak_gib(fused, ids)
    assert (fused_logits - plain_logits).abs().max() <= 0.05 * plain_logits.abs().max()
    torch.testing.assert_close(
        fused_grad.float(), plain_grad.float(), rtol=0.05, atol=0.05 * plain_grad.abs().max()
    )
    print(f"peak GiB: own RMSNorm {plain_peak:.2f}, fused {fused_peak:.2f}")
    assert fused_peak < plain_peak
