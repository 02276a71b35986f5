"""The fused head on a GPU: ``linear_logprobs_and_entropy`` equals the logits path within the bounds
``tests/unit/test_linear_logprobs.py`` derives (CUDA's kernels, bf16 and float32), and at a 0.5B head's
shape keeps far less than the logits path for a training pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reroll.algorithms.logprobs import linear_logprobs_and_entropy, selected_logprobs_and_entropy
from tests.unit.test_linear_logprobs import _bounds, _inputs, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 5])
def test_fused_equals_the_logits_path_on_cuda(dtype, chunk):
    h, w, b, y, g_lp, g_ent = (x.cuda() for x in _inputs(dtype, bias=True))
    fused = _run(True, h, w, b, y, 0.7, g_lp, g_ent, chunk)
    ref = _run(False, h, w, b, y, 0.7, g_lp, g_ent, chunk)
    bounds = _bounds(h, w, b, y, 0.7, g_lp, g_ent, torch.finfo(dtype).eps / 2, chunk)
    for name, bound in bounds.items():
        diff = (fused[name].detach().float() - ref[name].detach().float()).abs()
        assert (diff <= bound).all(), f"{name}: {float((diff - bound).max()):.3g} past the bound"


def _peak(fn) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30, logp


def test_a_training_pass_at_a_05b_head_keeps_no_logits():
    """K = 16384 scored tokens (64 rows of 256), H 896, V 151936, bf16: the logits path holds the logits
    and their gradient (4.6 GiB each); the fused head, blocks of 2**26 elements and the weight's gradient."""
    k, hid, v = 16384, 896, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(k, hid, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(v, hid, device="cuda", dtype=torch.bfloat16, generator=g).mul_(hid**-0.5)
    y = torch.randint(0, v, (k,), device="cuda", generator=g)

    def step(fused: bool):
        x, head = h.detach().requires_grad_(), w.detach().requires_grad_()
        if fused:
            logp, ent = linear_logprobs_and_entropy(x, head, None, y, 0.7)
        else:
            logp, ent = selected_logprobs_and_entropy(F.linear(x, head), y, 0.7)
        (logp.sum() + 0.01 * ent.sum()).backward()
        return logp.detach()

    logits_gib, want = _peak(lambda: step(False))
    fused_gib, got = _peak(lambda: step(True))
    print(f"peak GiB above the inputs: logits path {logits_gib:.2f}, fused {fused_gib:.2f}")
    # each path rounds the logits to bf16 once (2**-8 of max|x| at most, accumulation in float32 aside):
    # a log-softmax moves by at most twice its inputs' largest move
    x_max = float(F.linear(h, w).abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=4 * 2**-8 * x_max / 0.7)
    assert fused_gib < 0.25 * logits_gib
