"""The settings behind a step's speed that a CPU can check: AdamW's fused kernel on CUDA parameters,
vLLM's prefix caching of a group's shared prompt, and the token counts a step logs for MFU."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from reroll.config.rollout import VLLMConfig
from reroll.config.schema import RunConfig
from reroll.data.types import prompt_response_batch
from reroll.pipelines.rlvr import _token_metrics
from reroll.strategies.training import adamw_with_warmup, fused_adamw


def _param(device: str, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), dtype=dtype)  # what fused_adamw reads


def test_adamw_is_fused_only_where_every_parameter_is_a_floating_cuda_tensor():
    assert fused_adamw([_param("cuda"), _param("cuda", torch.float32)])
    assert not fused_adamw([_param("cuda"), _param("cpu")])
    assert not fused_adamw([_param("cuda", torch.int64)])
    assert not fused_adamw([])


@pytest.mark.parametrize("device, fused", [("cuda", True), ("cpu", None)])
def test_adamw_with_warmup_passes_the_choice_to_torch(device, fused):
    made = {}

    def adamw(params, **kwargs):
        made.update(kwargs)
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)  # a schedule needs a real one

    with mock.patch("torch.optim.AdamW", adamw):
        adamw_with_warmup([_param(device)], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0, warmup_steps=0)
    assert made["fused"] is fused and made["lr"] == 0.1


def test_a_real_cpu_adamw_keeps_torch_default():
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer, _ = adamw_with_warmup([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0, warmup_steps=0)
    assert optimizer.defaults["fused"] is None


class _Started(Exception):
    pass


def test_vllm_engine_caches_prompt_prefixes(tmp_path, monkeypatch):
    """The engine starts with ``enable_prefix_caching``: a group's samples share their prompt's KV blocks;
    on a GPU with CUDA graphs unless the config says otherwise; and without vLLM's per-token stats where
    its core runs in this process (the scheduler's load is read directly: ``_observe_scheduler``). A
    stand-in ``vllm`` module records the engine's arguments (no vLLM runs)."""
    from reroll.engines.vllm import VLLMEngine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    seen = {}

    def llm(**kwargs):
        seen.update(kwargs)
        raise _Started

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = llm, SimpleNamespace(__struct_fields__=())
    params = types.ModuleType("vllm.sampling_params")
    params.RequestOutputKind = SimpleNamespace(DELTA="delta", FINAL_ONLY="final")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", params)
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.delenv(key, raising=False)  # the engine sets them: undone after the test
    with pytest.raises(_Started):
        VLLMEngine(str(tmp_path), VLLMConfig(), device="cuda")
    assert seen["model"] == str(tmp_path)  # the engine got as far as starting vLLM
    assert seen["enable_prefix_caching"] is True
    assert seen["enforce_eager"] is False and seen["disable_log_stats"] is True


def test_a_step_counts_the_tokens_each_pass_computes(tmp_path):
    # two rows: 3 prompt + 2 response tokens, and 2 prompt + 4 response tokens (width 6, one pad)
    batch = prompt_response_batch([([1, 2, 3], [4, 5]), ([1, 2], [6, 7, 8, 9])], pad_token_id=0)
    kept = batch.select(torch.tensor([1]))  # the advantages kept the second row only

    def cfg(**sections) -> RunConfig:
        base = {"pipeline": "rlvr", "model": {"path": str(tmp_path)}, "data": {"train_files": ["x.jsonl"]}}
        return RunConfig.model_validate(base | sections)

    grpo = cfg(algorithm={"preset": "grpo", "kl_coef": 0.04})
    assert _token_metrics(grpo, batch, kept) == {
        "tokens/generated": 6.0,  # 2 + 4 response tokens
        "tokens/trained": 6.0,  # the kept row's 2 + 4
        "tokens/reference": 11.0,  # 5 + 6: prompts and responses, no padding
    }
    # two PPO epochs: the kept rows twice, and an old-log-prob pass (off-policy after the first update)
    ppo = cfg(algorithm={"preset": "grpo", "kl_coef": 0.0}, optim={"ppo_epochs": 2})
    assert _token_metrics(ppo, batch, kept) == {
        "tokens/generated": 6.0,
        "tokens/trained": 12.0,
        "tokens/old_logprobs": 11.0,
    }
