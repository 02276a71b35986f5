"""The engine share check against vLLM on this GPU (``reroll.config.role_memory.engine_share``): an engine
given the least share the check accepts starts and holds a full sequence, so the check lets through no
share too small to start. benchmarks/grpo_step.py's Qwen2.5-0.5B shape (random weights, built here),
bf16, 128 prompt + 256 new tokens. Skipped without CUDA or vLLM. vLLM's own memory profile (its log)
prints beside the estimate, for recalibration."""

from __future__ import annotations

import pytest
import torch

from benchmarks.grpo_step import QWEN25_05B
from reroll.engines import engine_available
from tests.conftest import small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not engine_available("vllm"), reason="needs vllm"),
]


def test_the_least_accepted_share_starts_and_generates(tmp_path):
    from reroll.config.role_memory import GIB, engine_share
    from reroll.data.types import SamplingParams
    from reroll.engines import make_engine
    from reroll.models.shape import model_shape
    from reroll.models.tiny import build_tiny_model

    model = build_tiny_model(
        tmp_path / "model",
        alphabet="0123456789abcdefghijklmnopqrstuvwxyz ",
        **QWEN25_05B,
        vocab_size=151936,
        max_position_embeddings=392,
        dtype="bfloat16",
        for_cpu_engine=False,
    )
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    overrides = ["rollout.engine=vllm", "model.dtype=bfloat16", "rollout.max_new_tokens=256"]
    cfg = small_config(tmp_path, *overrides, model=str(model))
    s = engine_share(cfg, model_shape(str(model)), gpu_memory_gib=total, prompt_tokens=128)
    assert s is not None
    print(f"least accepted share {s.least} of {total:.1f} GiB: need {s.need_gib:.2f} GiB ({s.parts})")
    cfg = small_config(
        tmp_path, *overrides, f"rollout.vllm.gpu_memory_utilization={s.least}", model=str(model)
    )
    engine = make_engine(str(model), cfg.rollout, dtype="bfloat16", device="cuda")
    out = engine.generate(["a" * 128], SamplingParams(n=2, max_new_tokens=256, seed=1))
    assert len(out) == 1 and len(out[0]) == 2  # it started, and held a full sequence
