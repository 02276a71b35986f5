"""Kit (c): disaggregated placement, the trainer on GPU 0 and a vLLM engine on GPU 1, the weights
broadcast over NCCL in buckets (transport 'collective', which 'auto' chooses for separate placement
with an in-process vLLM engine). The GPU run of ``tests/integration/test_weight_sync_collective.py``
(gloo there), through the run's own ``Roles``, with a random-init model of Qwen2.5-0.5B's shape (bf16,
0.99 GB: the rate means something at that size).

Asserted: the two roles sit on different GPUs; a sync carries every byte through the group; after it
the engine's sampling log-probs are the trainer's (bf16 both sides: mean gap below 0.02, largest below
0.25 nats, as ``tests/gpu/test_vllm_gpu.py``). Measured: the second sync's seconds and GB/s (the first
also forms the NCCL group), the log-prob gaps.
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

MEAN_GAP, MAX_GAP = 0.02, 0.25  # nats, bf16 both sides

APART = [
    "placement.devices=2",
    "placement.device_type=cuda",
    "roles.actor_train.devices=[0]",
    "roles.actor_infer.devices=[1]",
    "rollout.engine=vllm",
    "rollout.vllm.in_process=true",
    "rollout.vllm.gpu_memory_utilization=0.5",
    "rollout.vllm.max_model_len=256",
    "rollout.weight_sync_bucket_mb=256",
    "model.dtype=bfloat16",
    "algorithm.kl_coef=0.0",  # no reference role: the two GPUs hold one role each
]


def test_trainer_and_engine_on_separate_gpus_sync_over_nccl(tmp_path, assets, kit_record):
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
    from tests.multigpu.shaped import build_shaped

    model = build_shaped(tmp_path / "qwen2.5-0.5b-shape", "qwen2.5-0.5b")
    path = write_config(tmp_path / "c.yaml", {**assets, "model": model})
    cfg = load_config(path, RunConfig, APART)
    roles = Roles.start(cfg)
    try:
        assert weight_sync_transport(roles.cfg, "cuda") == "collective"
        engine, actor = roles.actor_infer, roles.actor_train

        tok = load_tokenizer(str(model))
        samples = load_samples([str(assets["train"])], template="{question}=")[:16]
        batch = sft_batch(samples, tok, "{answer}")
        rates = []
        for i in range(2):  # the first sync forms the group; the second is the rate of a step's sync
            with roles.phase("train", "actor_train"):
                if i == 0:
                    actor.configure_optimizer(1e-4, 0)
                actor.train(batch, NextToken())
            began = time.perf_counter()
            sent = roles.sync_weights()
            seconds = time.perf_counter() - began
            stats = roles.pop_timings()
            assert stats["sync/bytes_collective"] >= sent > 0.9e9  # every byte through the group
            rates.append((seconds, stats["sync/gb_per_s"]))
        assert engine.collective_bytes() == [2 * actor.collective_bytes()]  # both syncs, all of each
        [loaded] = engine.loaded_bytes()
        assert loaded["object_store"] == 0

        sampled, trainer = engine_samples_scored(roles, samples, tok, 8)
        m = sampled.response_mask
        diff = (sampled.rollout_logprobs[m] - trainer[m]).abs()
        (first_s, _), (seconds, rate) = rates
        print(f"sync of {sent / 1e9:.2f} GB: first {first_s:.2f} s (forms the group), then {seconds:.2f} s")
        kit_record("sync rate", rate, "GB/s")
        kit_record("sync", seconds, "s")
        kit_record("first sync (forms the group)", first_s, "s")
        kit_record("log-prob max diff", float(diff.max()), "nats")
        assert float(diff.mean()) < MEAN_GAP and float(diff.max()) < MAX_GAP, diff
        # where it ran (checked last, so that a run on CPUs checks everything else): two GPUs
        uuid = lambda _: str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)  # noqa: E731
        [trainer_gpu] = ray.get([h.__ray_call__.remote(uuid) for h in actor.handles], timeout=60)
        [engine_gpu] = ray.get([h.__ray_call__.remote(uuid) for h in engine.handles], timeout=60)
        assert trainer_gpu != engine_gpu
    finally:
        roles.shutdown()
