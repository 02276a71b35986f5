"""Packed rows on a GPU: ``packed_attention`` runs torch's variable-length flash-attention kernel, and a
packed micro-batch gives the padded one's log-probs and gradients (bf16 tolerance)."""

from __future__ import annotations

import pytest
import torch

from reroll.data.packing import pack, unpack
from reroll.data.types import TrainBatch
from reroll.models import packed_attention
from reroll.models.loading import position_ids_from
from reroll.strategies.training import forward_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model() -> torch.nn.Module:
    """The unit tests' two-layer Qwen2 (2 heads of 32, 1 kv head: grouped-query) in bf16 on the GPU."""
    from transformers import Qwen2ForCausalLM

    from tests.unit.test_packing import _qwen2

    return _qwen2(Qwen2ForCausalLM, "sdpa").to("cuda", torch.bfloat16)


def test_packed_rows_use_the_varlen_kernel_and_match_padded_rows(monkeypatch):
    assert packed_attention._varlen() is not None, "torch has no torch.nn.attention.varlen here"
    calls = []
    flash = packed_attention._flash_rows
    monkeypatch.setattr(packed_attention, "_flash_rows", lambda *a: calls.append(1) or flash(*a))
    padded_model, packed_model = _model(), _model()
    assert packed_attention.attend_rows_apart(packed_model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([300, 17, 256, 1, 129, 64])
    mask = torch.arange(300)[None] < lengths[:, None]
    ids = torch.randint(3, 16, mask.shape, generator=g) * mask
    dev = torch.device("cuda")

    padded = forward_logits(padded_model, dev, ids, mask, position_ids_from(mask)).float()
    p = pack(TrainBatch(input_ids=ids, attention_mask=mask, response_mask=mask, group_ids=torch.arange(6)))
    packed = unpack(forward_logits(packed_model, dev, p.input_ids, None, p.position_ids), p, 300).float()
    assert len(calls) == 2  # one call a layer, each over all rows
    real = mask.to(dev)
    diff = (packed - padded)[real].abs().max().item()
    assert diff < 0.1, diff  # bf16 logits of order 1
    logp = lambda x: x.log_softmax(-1)[real].gather(-1, ids.to(dev)[real][:, None]).sum()  # noqa: E731
    logp(padded).backward()
    logp(packed).backward()
    for (name, a), b in zip(padded_model.named_parameters(), packed_model.parameters(), strict=True):
        rel = ((a.grad.float() - b.grad.float()).norm() / a.grad.float().norm()).item()
        assert rel < 0.05, (name, rel)
