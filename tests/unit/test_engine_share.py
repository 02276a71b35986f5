"""A GPU engine's share of its GPU against what its start needs (``role_memory.engine_share``): refused by
``reroll validate`` / ``train`` (preflight) and ``reroll plan`` before anything starts, with the share that
would hold it. The numbers are the H100 runs of ``benchmarks/grpo_step.py --rows ray-dp4 / ray-dp2
--vllm-memory 0.15`` (Qwen2.5-0.5B, bf16, 128 prompt + 256 new tokens): four engines at 0.0375 each
failed in vLLM ("No available memory for the cache blocks"), as four at 0.05 had (``--vllm-memory 0.2``);
two at 0.075 started."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from reroll.config.memory import known_shape
from reroll.config.role_memory import GIB, engine_share, engine_share_problem
from reroll.pipelines import preflight
from reroll.pipelines.preflight import check_inputs
from reroll.pipelines.preflight_machine import Machine
from reroll.plan import plan
from tests.conftest import small_config

H100 = 85_045_526_528 / GIB  # torch's total_memory of an H100 80GB HBM3: 79.2 GiB
SHAPE = known_shape("Qwen/Qwen2.5-0.5B")

# By hand, Qwen2.5-0.5B in bf16 on a GPU of >= 70 GiB (vLLM's LLM defaults there: 1024 sequences,
# 16384 tokens a step):
WEIGHTS = 494e6 * 2  # 0.920 GiB
SAMPLER = 1024 * 151936 * 20  # 20 bytes a logit: 2.898 GiB
FORWARD = 16384 * (3 * 4864 + 6 * 896) * 2  # 0.609 GiB, below the sampler's
OVERHEAD = SAMPLER + 0.25 * GIB  # the larger of the two, and the allowance outside torch: 3.148 GiB
KV = (128 + 256) * 2 * 24 * 2 * 64 * 2  # one 384-token sequence: K and V, 24 layers, 2 heads of 64
NEED = (WEIGHTS + OVERHEAD + KV) / GIB  # 4.073 GiB


def _cfg(tmp_path: Path, engines: int, share: float, *overrides: str):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n')
    return small_config(
        tmp_path,
        f"data.train_files=[{rows}]",
        f"output_dir={tmp_path}/run",
        "model.dtype=bfloat16",
        "rollout.engine=vllm",
        "rollout.max_new_tokens=256",
        "placement.devices=1",
        f"roles.actor_infer.world_size={engines}",
        f"rollout.vllm.gpu_memory_utilization={share}",
        *overrides,
        model="Qwen/Qwen2.5-0.5B",
    )


def test_the_need_by_hand(tmp_path):
    assert FORWARD < SAMPLER
    s = engine_share(_cfg(tmp_path, 1, 0.15), SHAPE, gpu_memory_gib=H100, prompt_tokens=128)
    assert s is not None and s.need_gib == pytest.approx(NEED)
    # the H100 run that failed: the weights and the profile alone took more than 2.97 GiB
    assert (WEIGHTS + OVERHEAD) / GIB > 0.0375 * H100


def test_four_engines_at_0_0375_are_refused_two_at_0_075_start(tmp_path):
    four = engine_share_problem(_cfg(tmp_path, 4, 0.0375), SHAPE, gpu_memory_gib=H100, prompt_tokens=128)
    assert four is not None
    key, message = four
    assert key == "rollout.vllm.gpu_memory_utilization"
    # 4.073 / 79.2 = 0.05142: the least share rounded up to 3 decimals
    assert "is 2.97 GiB for one engine rank, which needs 4.07 GiB" in message
    assert "at least 0.052" in message and "fewer engines on a GPU (4 share one now" in message
    assert "max_model_len" not in message  # a hub id's context is not known here: the run's 384 tokens
    also = engine_share_problem(_cfg(tmp_path, 4, 0.05), SHAPE, gpu_memory_gib=H100, prompt_tokens=128)
    assert also is not None and "is 3.96 GiB" in also[1]
    two = engine_share_problem(_cfg(tmp_path, 2, 0.075), SHAPE, gpu_memory_gib=H100, prompt_tokens=128)
    assert two is None
    one = _cfg(tmp_path, 1, 0.052)  # the least share holds it
    assert engine_share_problem(one, SHAPE, gpu_memory_gib=H100, prompt_tokens=128) is None


def test_a_smaller_gpu_takes_vllm_s_smaller_batch_defaults(tmp_path):
    """Below 70 GiB vLLM profiles 256 sequences and 8192 tokens: the sampler's 256 x 151936 x 20 bytes."""
    s = engine_share(_cfg(tmp_path, 1, 0.5), SHAPE, gpu_memory_gib=24.0, prompt_tokens=128)
    assert s is not None
    assert s.need_gib == pytest.approx((WEIGHTS + 256 * 151936 * 20 + 0.25 * GIB + KV) / GIB)


def test_max_model_len_sizes_the_one_sequence(tmp_path):
    """vLLM asks room for one sequence of its max_model_len, where set."""
    cfg = _cfg(tmp_path, 1, 0.5, "rollout.vllm.max_model_len=32768")
    s = engine_share(cfg, SHAPE, gpu_memory_gib=H100, prompt_tokens=128)
    assert s is not None and s.need_gib == pytest.approx((WEIGHTS + OVERHEAD + KV / 384 * 32768) / GIB)


def test_the_model_s_context_sizes_the_one_sequence_where_max_model_len_is_unset(tmp_path):
    """vLLM's default max_model_len is the model's context (a local config.json's
    max_position_embeddings): 32768 tokens of Qwen2.5-0.5B's 12288 bytes are 0.375 GiB, which the
    refusal names with the setting that shortens it."""
    local = dataclasses.replace(SHAPE, context=32768)
    s = engine_share(_cfg(tmp_path, 2, 0.075), local, gpu_memory_gib=H100, prompt_tokens=128)
    assert s is not None and s.need_gib == pytest.approx((WEIGHTS + OVERHEAD + KV / 384 * 32768) / GIB)
    assert s.need_gib == pytest.approx(4.443, abs=1e-3) and s.share_gib > s.need_gib  # two engines started
    found = engine_share_problem(_cfg(tmp_path, 4, 0.05), local, gpu_memory_gib=H100, prompt_tokens=128)
    assert found is not None
    assert "or set rollout.vllm.max_model_len to the longest prompt + response" in found[1]
    assert "takes 0.38 GiB" in found[1]


def _share_problems(cfg, machine: Machine) -> list[str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(preflight, "package_problems", lambda cfg, **kw: [])
        found = check_inputs(cfg, machine)
    return [p.message for p in found if p.path == "rollout.vllm.gpu_memory_utilization"]


def test_validate_refuses_the_share_on_a_gpu_machine_and_not_on_a_cpu_one(tmp_path):
    """``reroll validate`` and ``train`` (one preflight) refuse before any worker starts, where the
    machine's GPU memory is known; a CPU engine's share is of host memory, not checked."""
    h100 = Machine(cpus=16.0, gpus=1, gpu_memory_gib=H100)
    refused = _share_problems(_cfg(tmp_path, 4, 0.0375), h100)
    # no prompt tokens counted here: (4.073 - 128 x 12288 / 2**30) / 79.2 = 0.05140, still 0.052
    assert len(refused) == 1 and "at least 0.052" in refused[0]
    assert _share_problems(_cfg(tmp_path, 2, 0.075), h100) == []
    assert _share_problems(_cfg(tmp_path, 4, 0.0375), Machine(cpus=16.0, gpus=1)) == []  # size unknown
    cpu = _cfg(tmp_path, 4, 0.0375, "placement.device_type=cpu")
    assert _share_problems(cpu, Machine(cpus=16.0, gpus=1, gpu_memory_gib=H100)) == []


def test_plan_prints_the_share_against_the_need_and_refuses_what_validate_refuses(tmp_path):
    text, fits = plan(_cfg(tmp_path, 4, 0.0375), gpus=1, gpu_memory_gib=H100, prompt_tokens=128)
    assert "engine share, each rank: 0.0375 = 2.97 GiB against 4.07 GiB to start" in text
    assert "too small: at least 0.052" in text and not fits
    assert "cannot start" in text and "rollout.vllm.gpu_memory_utilization: 0.0375 of a 79.2 GiB GPU" in text
    text, _ = plan(_cfg(tmp_path, 2, 0.075), gpus=1, gpu_memory_gib=H100, prompt_tokens=128)
    assert "0.075 = 5.94 GiB against 4.07 GiB to start" in text and "holds it" in text
    assert "cannot start" not in text


def test_train_s_preflight_on_this_machine_raises_it_before_anything_starts(tmp_path, monkeypatch):
    """``run()`` and ``reroll validate`` call ``preflight`` first: on a machine whose GPUs NVML reports
    (``Machine.here``), the share is one ``UserError`` naming the key and the fix."""
    from reroll.errors import UserError

    here = Machine(cpus=16.0, gpus=1, gpu_memory_gib=H100)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # train starts its cluster here: this machine checked
    monkeypatch.setattr(Machine, "here", classmethod(lambda cls: here))
    monkeypatch.setattr(preflight, "package_problems", lambda cfg, **kw: [])
    with pytest.raises(UserError) as e:
        preflight.preflight(_cfg(tmp_path, 4, 0.0375))
    assert "rollout.vllm.gpu_memory_utilization" in str(e.value) and "at least 0.052" in str(e.value)
    preflight.preflight(_cfg(tmp_path, 2, 0.075))  # two engines at 0.075: nothing raised


def test_auto_is_checked_as_the_engine_a_gpu_run_starts(tmp_path, monkeypatch):
    """'auto' starts vLLM on a GPU where it is installed (``resolve_engine``), else hf: no fixed share."""
    from reroll.config import engines

    cfg = _cfg(tmp_path, 4, 0.0375, "rollout.engine=auto")
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)
    assert engine_share(cfg, SHAPE, gpu_memory_gib=H100, prompt_tokens=128) is None
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: object())
    assert engine_share_problem(cfg, SHAPE, gpu_memory_gib=H100, prompt_tokens=128) is not None
