"""FSDP2 on one GPU (NCCL, 1 rank): the same step as the torch strategy, and offload()/reload() that
really free the GPU and bring back the same weights and optimizer state."""

from __future__ import annotations

import pytest
import torch

from reroll.config.schema import RunConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cfg(path, **strategy) -> RunConfig:
    raw = {"pipeline": "rlvr", "model": {"path": str(path)}, "data": {"train_files": ["x.jsonl"]}}
    return RunConfig.model_validate(raw | {"strategy": {"name": "fsdp2", **strategy}})


def _step(s, ids):
    logits = s.logits(ids, torch.ones_like(ids, dtype=torch.bool))
    s.backward(logits.float().log_softmax(-1)[..., 5].mean())
    return s.step(1.0)


def test_fsdp2_cuda_step_and_offload_round_trip(assets):
    from torch.distributed.tensor import DTensor

    from reroll.strategies.fsdp2 import FSDP2Strategy
    from reroll.strategies.torch_strategy import TorchStrategy

    cfg = _cfg(assets["model"])
    ids = torch.randint(3, 20, (4, 12), generator=torch.Generator().manual_seed(0))
    ref = TorchStrategy(cfg.model.path, cfg=cfg, device="cuda")
    s = FSDP2Strategy(cfg.model.path, cfg=cfg, device="cuda")
    for strat in (ref, s):
        strat.configure_optimizer(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0)
    m_ref, m = _step(ref, ids), _step(s, ids)
    assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-4)
    assert 0 < m["peak_memory_gb"] < 1
    full, full_ref = s.full_state_dict(), ref.full_state_dict()
    assert max((full[k] - full_ref[k]).abs().max().item() for k in full) <= 2e-2  # Adam on ~0 grads

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().clone()

    del ref  # only the FSDP2 strategy on the GPU now
    weights = {k: local(v) for k, v in s.model.state_dict().items()}
    moments = [local(st["exp_avg_sq"]) for st in s.optimizer.state.values()]
    held = sum(local(p).numel() * local(p).element_size() for p in s.model.parameters()) + sum(
        local(t).numel() * local(t).element_size() for st in s.optimizer.state.values() for t in st.values()
    )
    parked = sum(  # what the parking holds: parameters, buffers and Adam moments, not the step counters
        t.numel() * t.element_size()
        for t in [
            *(p.to_local() for p in s.model.parameters()),
            *s.model.buffers(),
            *(v.to_local() for st in s.optimizer.state.values() for k, v in st.items() if k != "step"),
        ]
    )
    on_gpu = torch.cuda.memory_allocated()
    s.offload()
    assert on_gpu - torch.cuda.memory_allocated() >= 0.9 * held  # parameters and Adam state left the GPU
    assert all(local(v).device.type == "cpu" for v in s.model.state_dict().values())
    assert all(p.to_local().is_pinned() for p in s.model.parameters())  # copied without waiting
    assert s._parked.pinned_bytes == parked  # each shard in a buffer of its size, nothing rounded up
    first = [p.to_local().data_ptr() for p in s.model.parameters()]
    s.reload()
    s.offload()  # the second offload copies into the first one's buffers
    assert [p.to_local().data_ptr() for p in s.model.parameters()] == first
    assert all(p.to_local().is_pinned() for p in s.model.parameters())
    s.reload()
    assert all(v.device.type == "cuda" for v in s.model.state_dict().values())
    assert all(torch.equal(local(v), weights[k]) for k, v in s.model.state_dict().items())
    assert all(torch.equal(local(st["exp_avg_sq"]), b) for st, b in zip(s.optimizer.state.values(), moments))
    assert torch.isfinite(torch.tensor(_step(s, ids)["grad_norm"]))  # trains on after the round trip
