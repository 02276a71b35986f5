"""The vision tower's segment attention batched by length (``reroll.models.vision_attention``) computes
what transformers' per-segment sdpa loop computes, in a block and in a whole Qwen2.5-VL model, and
leaves the text model's attention as it was.

Tolerance: both sides run the same ``scaled_dot_product_attention`` on the same rows of each segment in
fp32; ours hands the kernel ``n`` segments as a batch instead of one a call, so each output element is
the same dot products and softmax over the same ``L`` keys, but the kernel may block and order its
reductions differently for another batch size: rounding of order eps(fp32) = 1.2e-7 times a few
reductions of ``L`` terms. Measured (AMD EPYC, default and AVX2 kernels): 1e-7 to 4e-7 of the largest
element at L <= 64, 1.1e-6 at L = 1024. RTOL = ATOL = 1e-5 holds that with a margin; attending across a
segment boundary changes outputs by ~1e-1, which ``test_a_wrong_boundary_is_seen`` checks is caught.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

from reroll.algorithms.logprobs import token_logprobs
from reroll.models import vision_attention
from reroll.models.loading import load_causal_lm, use_kernels
from reroll.models.tiny_vision import MERGE, PATCH, build_tiny_vl_model
from reroll.models.vision_attention import (
    NAME,
    attend_segments_batched,
    plan_segments,
    segments_attention,
    switch_vision_config,
)

TOL = dict(rtol=1e-5, atol=1e-5)
# mixed lengths: some repeated (3, 5), some alone (7, 1), one empty, not sorted
LENGTHS = [5, 3, 5, 7, 3, 0, 3, 1, 5]


def _bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _loop(q, k, v, cu, scale):
    """The reference: one SDPA call per segment, as transformers' vision attention does for sdpa."""
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), scale=scale
        ).transpose(0, 1)
        for a, b in itertools.pairwise(cu.tolist())
    ]
    return torch.cat(outs)


def test_plan_groups_segments_by_length_and_restores_the_order():
    plan = plan_segments(_bounds(LENGTHS).tolist())
    assert [(g.length, g.count) for g in plan.groups] == [(1, 1), (3, 3), (5, 3), (7, 1)]
    assert plan.inverse is not None  # the 3s and 5s are interleaved: outputs need putting back
    equal = plan_segments(_bounds([4, 4, 4]).tolist())  # windows of one length, end to end: no gather
    assert len(equal.groups) == 1 and equal.groups[0].index is None and equal.inverse is None
    with pytest.raises(ValueError, match="cu_seqlens"):
        plan_segments([0, 5, 3])


def test_batched_segments_equal_the_per_segment_loop_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    cu = _bounds(LENGTHS)
    n, heads, dim = int(cu[-1]), 3, 8
    inputs = [torch.randn(n, heads, dim, generator=gen, dtype=torch.float64).float() for _ in range(3)]
    grad = torch.randn(n, heads, dim, generator=gen)
    results = []
    for fn in (_loop, lambda q, k, v, cu, s: segments_attention(q, k, v, cu, scale=s)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves, cu, 0.3)
        out.backward(grad)
        results.append((out.detach(), *(x.grad for x in leaves)))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, **TOL)


def test_a_wrong_boundary_is_seen():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, 2, 8, generator=gen) for _ in range(3))
    want = _loop(q, k, v, _bounds([4, 4, 4]), None)
    assert not torch.allclose(segments_attention(q, k, v, _bounds([4, 8]), scale=None), want, **TOL)


def _qwen25_vl_block():
    return Qwen2_5_VLVisionAttention(Qwen2_5_VLVisionConfig(hidden_size=32, num_heads=4))


def _qwen2_vl_block():
    return VisionAttention(Qwen2VLVisionConfig(embed_dim=32, num_heads=4))


@pytest.mark.parametrize("make", [_qwen25_vl_block, _qwen2_vl_block], ids=["qwen2_5_vl", "qwen2_vl"])
def test_the_vision_block_attention_equals_transformers_sdpa_loop(make):
    """Through transformers' own vision attention (Qwen2.5-VL's, Qwen2-VL's): its flash branch (chosen
    by our name) calling ours, against its sdpa branch's loop; the plan is built once for the tensor."""
    torch.manual_seed(0)
    block = make()
    config = block.config
    cu = _bounds(LENGTHS)
    n, head_dim = int(cu[-1]), 8
    x = torch.randn(n, 32)
    angles = torch.randn(n, head_dim // 2).repeat(1, 2)
    rotary = (angles.cos(), angles.sin())
    results = []
    for name in ("sdpa", NAME):
        block.zero_grad()
        if name == NAME:
            assert switch_vision_config(config)
        else:
            config._attn_implementation = "sdpa"
        leaf = x.clone().requires_grad_()
        out = block(leaf, cu_seqlens=cu, position_embeddings=rotary, max_seqlen=max(LENGTHS))
        out.square().sum().backward()
        results.append((out.detach(), leaf.grad, *(p.grad.clone() for p in block.parameters())))
    assert config._attn_implementation == NAME
    assert vision_attention._PLANS[id(cu)][0]() is cu  # ours ran: it planned this tensor's segments
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, **TOL)


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    # images up to 48x48 pixels: 12x12 patches, 6x6 image tokens, so windows of 4x4 tokens come in
    # three sizes (4x4, 4x2, 2x2: 64, 32, 16 patches)
    path = tmp_path_factory.mktemp("vl") / "m"
    return str(build_tiny_vl_model(path, alphabet="0123456789 abc?", vision_depth=3, max_pixels=48 * 48))


def _image_rows(model: Qwen2_5_VLForConditionalGeneration) -> dict:
    """Two rows with images of 48x48, 32x32 and 48x32 pixels (6x6, 4x4, 6x4 tokens), random pixels."""
    gen = torch.Generator().manual_seed(2)
    grids = torch.tensor([[1, 12, 12], [1, 8, 8], [1, 12, 8]])
    patch = 3 * 2 * PATCH * PATCH  # channels x temporal patch x pixels
    pixels = torch.randn(int(grids.prod(-1).sum()), patch, generator=gen)
    image = model.config.image_token_id
    tokens = (grids.prod(-1) // MERGE**2).tolist()
    rows = [[1, 2, *[image] * tokens[0], 3, *[image] * tokens[1], 4], [5, *[image] * tokens[2], 6, 7]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": pixels,
        "image_grid_thw": grids,
        "mm_token_type_ids": (ids == image).int(),
    }


def test_a_tiny_qwen25_vl_gives_the_same_logprobs_and_gradients(tiny_vl, monkeypatch):
    model = load_causal_lm(tiny_vl)
    inputs = _image_rows(model)
    calls = []
    monkeypatch.setattr(
        vision_attention,
        "segments_attention",
        lambda *a, **k: calls.append(1) or segments_attention(*a, **k),
    )
    results = []
    for batched in (False, True):
        model.zero_grad()
        if batched:
            assert attend_segments_batched(model)
        logprobs = token_logprobs(model(**inputs).logits, inputs["input_ids"])
        (logprobs * inputs["attention_mask"]).sum().backward()
        results.append((logprobs.detach(), *(p.grad.clone() for p in model.parameters())))
    assert len(calls) == 3  # ours ran, once a vision block (windowed, windowed, full)
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, **TOL)


def test_the_text_model_keeps_its_attention(tiny_vl):
    model = load_causal_lm(tiny_vl)
    assert attend_segments_batched(model)
    assert model.config.vision_config._attn_implementation == NAME
    assert model.model.visual.config._attn_implementation == NAME
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "sdpa"
    assert model.model.language_model.config._attn_implementation == "sdpa"
    assert not attend_segments_batched(torch.nn.Linear(1, 1))  # no vision config: nothing to do


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("batched", [True, False])
def test_the_strategies_kernels_switch_the_vision_tower_alone(tiny_vl, packing, batched):
    """``use_kernels``, as every HF strategy calls it after loading: the vision tower batched (unless
    ``model.batched_vision_attention`` is false), the text model on what it would run without us (sdpa,
    or packed attention where packing is on, whose setting also reaches the vision config and must not
    win there)."""
    from reroll.models.packed_attention import NAME as PACKED

    model = load_causal_lm(tiny_vl)
    cfg = SimpleNamespace(
        model=SimpleNamespace(fused_norm=False, batched_vision_attention=batched),
        optim=SimpleNamespace(packing=packing),
        compute_dtype="float32",
    )
    use_kernels(model, cfg, torch.device("cpu"))
    text = PACKED if packing else "sdpa"
    assert model.model.visual.config._attn_implementation == (NAME if batched else text)
    assert model.config.text_config._attn_implementation == text
