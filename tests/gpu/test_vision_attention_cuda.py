"""``model.batched_vision_attention`` on a GPU: the vision tower's segments batched by length give
transformers' per-segment sdpa loop's results, at Qwen2.5-VL-3B's head size (80) with its 64-patch
windows and whole 1024-patch images, in fp32 and bf16, forward and backward.

Tolerance: fp32 as on the CPU (tests/unit/test_vision_attention.py: the same SDPA per segment, summed
in another order at most, ~1e-6 relative; 1e-5). bf16: torch may pick another kernel for a batch than for
one segment, so the two can differ by bf16 rounding (2^-8 relative) rather than agree bit for bit; the
test asks that ours be as close to an fp32 reference as the loop is (within twice the loop's largest
error), which a wrong boundary (errors of order 1e-1) fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from reroll.models.vision_attention import segments_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# 16 windows of 64 patches (one 448-px image), two whole images, a few odd windows at an image's edge
LENGTHS = [64] * 16 + [1024, 32, 64, 16, 1024, 32]
HEADS, DIM = 16, 80


def _loop(q, k, v, cu):
    return torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v))
            ).transpose(0, 1)
            for a, b in itertools.pairwise(cu.tolist())
        ]
    )


def _run(fn, inputs, grad, dtype):
    leaves = [x.detach().clone().to(dtype).requires_grad_() for x in inputs]  # new leaves every call
    out = fn(*leaves)
    out.backward(grad.to(dtype))
    return [t.float() for t in (out.detach(), *(x.grad for x in leaves))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_segments_equal_the_loop_on_cuda(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, *itertools.accumulate(LENGTHS)], dtype=torch.int32, device="cuda")
    n = int(cu[-1])
    inputs = [torch.randn(n, HEADS, DIM, device="cuda", generator=gen) for _ in range(3)]
    grad = torch.randn(n, HEADS, DIM, device="cuda", generator=gen)

    def ours(q, k, v):
        return segments_attention(q, k, v, cu)

    def loop(q, k, v):
        return _loop(q, k, v, cu)

    reference = _run(loop, inputs, grad, torch.float32)
    got, want = _run(ours, inputs, grad, dtype), _run(loop, inputs, grad, dtype)
    for g, w, r in zip(got, want, reference):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        else:
            assert (g - r).abs().max() <= 2 * (w - r).abs().max() + 1e-6
