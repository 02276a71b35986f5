"""The per-size example for one GPU, started on one: ``examples/qwen2.5-0.5b-rlvr_fsdp2`` as shipped
(fsdp2 with activation checkpointing, vLLM colocated with sleep mode and CUDA graphs, 256 samples of up to
1024 new tokens, 4 mini-batches, math_verify rewards, chat template), with only what cannot be downloaded
here replaced: the model is a random-init one of Qwen2.5-0.5B's shape (vocabulary 151,936) with the tiny
kit's character tokenizer and chat template, and the data are local arithmetic rows. Two steps, a
held-out evaluation before and after, and the final checkpoint loadable with ``from_pretrained``.

Skipped without CUDA, vLLM or math-verify (``../shared/device/make-bundle.sh`` packs the latter).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.grpo_step import QWEN25_05B
from tests.conftest import ROOT, reroll_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
    pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math-verify"),
]

EXAMPLE = ROOT / "examples" / "qwen2.5-0.5b-rlvr_fsdp2" / "config.yaml"


def test_the_one_gpu_example_starts_trains_and_checkpoints(tmp_path):
    from transformers import AutoModelForCausalLM

    from reroll.data.arithmetic import write_arithmetic_dataset
    from reroll.models.tiny import build_tiny_model
    from reroll.runtime.metrics import read_metrics

    model = build_tiny_model(
        tmp_path / "qwen2.5-0.5b-shape",
        alphabet="ascii",
        vocab_size=151936,
        max_position_embeddings=2048,
        dtype="bfloat16",
        for_cpu_engine=False,
        **QWEN25_05B,
    )
    data = write_arithmetic_dataset(
        tmp_path / "data", n_train=600, n_test=64, max_operand=99, ops="+", seed=0
    )
    out = reroll_cli(
        "train",
        EXAMPLE,
        f"output_dir={tmp_path}/{{name}}",
        f"model.path={model}",
        f"data.train_files=[{data['train']}]",
        f"data.eval_files=[{data['test']}]",
        "data.eval_limit=32",
        "total_steps=2",
        timeout=540,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / "qwen2.5-0.5b-rlvr_fsdp2"
    rows = read_metrics(run)
    print(
        "\n".join(
            f"step {r['step']}: " + ", ".join(f"{k} {r[k]:.3g}" for k in sorted(r) if k.startswith("timing/"))
            for r in rows
        )
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/response_length"] > 0 and r.get("sync/bytes", 0) > 0 for r in rows[1:])
    [ckpt] = sorted((run / "checkpoints").glob("step_*"))
    loaded = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    assert loaded.config.num_hidden_layers == QWEN25_05B["num_layers"]
