"""A colocated trainer's offload on a GPU (``HostParking`` in the torch strategy): its state goes to
page-locked host buffers of its exact size, reused at every offload, its GPU memory is freed, and after
reload the model trains on exactly as one that never moved."""

from __future__ import annotations

import time

import pytest
import torch

from reroll.config.schema import RunConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _step(s, ids):
    logits = s.logits(ids, torch.ones_like(ids, dtype=torch.bool))
    s.backward(logits.float().log_softmax(-1)[..., 5].mean())
    return s.step(1.0)


def test_offload_parks_in_reused_pinned_buffers_and_training_goes_on_unchanged(assets):
    from reroll.strategies.torch_strategy import TorchStrategy

    raw = {"pipeline": "rlvr", "model": {"path": str(assets["model"])}, "data": {"train_files": ["x.jsonl"]}}
    cfg = RunConfig.model_validate(raw | {"model": {"path": str(assets["model"]), "dtype": "float32"}})
    ids = torch.randint(3, 20, (4, 12), generator=torch.Generator().manual_seed(0))
    moved, still = (TorchStrategy(cfg.model.path, cfg=cfg, device="cuda") for _ in range(2))
    for s in (moved, still):
        s.configure_optimizer(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0)
        _step(s, ids)

    def state_bytes() -> int:  # no reference kept: the test must not hold what offload frees
        moments = [v for st in moved.optimizer.state.values() for k, v in st.items() if k != "step"]
        tensors = [*moved.model.parameters(), *moved.model.buffers(), *moments]
        return sum(t.numel() * t.element_size() for t in tensors)

    held, on_gpu = state_bytes(), torch.cuda.memory_allocated()
    pointers = None
    for _ in range(2):
        moved.offload()
        assert on_gpu - torch.cuda.memory_allocated() >= held  # parameters, buffers, both Adam moments
        assert all(p.device.type == "cpu" and p.is_pinned() for p in moved.model.parameters())
        moments = [v for st in moved.optimizer.state.values() for k, v in st.items() if k != "step"]
        assert all(v.device.type == "cpu" and v.is_pinned() for v in moments)
        assert moved._parked.pinned_bytes == held  # exact sizes, nothing rounded up
        now = [t.data_ptr() for t in [*moved.model.parameters(), *moved.model.buffers(), *moments]]
        assert pointers in (None, now)  # the second offload reuses the first one's buffers
        pointers = now
        del moments
        moved.reload()
        assert all(p.device.type == "cuda" for p in moved.model.parameters())
        assert torch.cuda.memory_allocated() == on_gpu

    for _ in range(2):  # the moved model steps exactly as the one that stayed
        a, b = _step(moved, ids), _step(still, ids)
        assert a["grad_norm"] == b["grad_norm"]
    for (name, p), q in zip(moved.model.named_parameters(), still.model.parameters()):
        assert torch.equal(p, q), name


def test_storages_park_in_place_keeping_their_tensors():
    """Megatron's way (``HostParking.park_storages``): a storage and its views stay the same objects (a
    hook on a parameter, an optimizer shard viewing a buffer), their GPU memory is freed, the host copy
    is page-locked at its exact size and reused, and the values come back."""
    from reroll.strategies.host_parking import HostParking

    param = torch.nn.Parameter(torch.randn(1000, 257, device="cuda"))
    moment = torch.randn(3001, device="cuda", dtype=torch.bfloat16)
    shard = moment[1000:2000]  # a view: parked with its storage, never on its own
    hooked = []
    param.register_hook(hooked.append)
    want = (param.detach().clone(), moment.clone())
    storages = [param.untyped_storage(), moment.untyped_storage()]
    parking, on_gpu = HostParking(), torch.cuda.memory_allocated()
    exact = param.untyped_storage().nbytes() + moment.untyped_storage().nbytes()
    pointers = None
    for _ in range(2):
        restore = parking.park_storages(storages)
        assert on_gpu - torch.cuda.memory_allocated() >= exact
        assert param.untyped_storage().nbytes() == 0 and shard.untyped_storage().nbytes() == 0
        assert parking.pinned_bytes == exact
        now = [b.data_ptr() for b in parking.buffers]
        assert pointers in (None, now)  # the second offload reuses the first one's buffers
        pointers = now
        for bring_back in restore:
            bring_back()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == on_gpu
        assert torch.equal(param.detach(), want[0]) and torch.equal(moment, want[1])
        assert torch.equal(shard, want[1][1000:2000])
    (param * 2).sum().backward()  # the hook registered before parking still fires
    assert len(hooked) == 1 and torch.equal(param.grad, torch.full_like(param, 2.0))


def _linear_trainer(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """1.6 GB of state in 96 tensors: 16 bf16 layers of 4096 x 4096 with biases (0.54 GB), two moments each."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4096, 4096, dtype=torch.bfloat16, device=device) for _ in range(16)]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6)


def _train_once(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _offload_seconds(parking, model, optimizer, times: int) -> list[float]:
    out = []
    for _ in range(times):
        torch.cuda.synchronize()
        start = time.perf_counter()
        parking.offload(model, optimizer)  # ends with a device synchronisation
        out.append(time.perf_counter() - start)
        parking.reload(model, optimizer, torch.device("cuda"))
        torch.cuda.synchronize()
    return out


def test_a_prepared_first_offload_costs_what_the_later_ones_do():
    """Buffers prepared ahead (``HostParking.prepare_for``, started before the first step as the workers
    do, AdamW's moments predicted): the first offload only copies, so it takes about as long as the
    later ones. Bound 1.5x the median of three later offloads: the same copies into the same
    page-locked buffers, ended by one synchronisation; what may differ is noise on a ~30 ms move
    (1.6 GB at ~50 GB/s). Unprepared, the first offload also page-locks every buffer: 11-16x the later
    ones in benchmarks/offload.py (H100, H200), which the control below checks is still the case here
    (> 2x), so that the bound is not met by a machine where pinning costs nothing."""
    from reroll.strategies.host_parking import HostParking

    model, optimizer = _linear_trainer("cuda")
    prepared = HostParking()
    prepared.prepare_for(model, optimizer, torch.device("cuda"), worth_it=lambda nbytes: True)
    _train_once(model, optimizer)  # beside the preparation, as step 1 runs beside it in a run
    prepared.wait_prepared()
    made = sorted(b.data_ptr() for b in prepared.buffers)
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    assert prepared.pinned_bytes == state  # parameters and both moments, locked before any offload
    first, *later = _offload_seconds(prepared, model, optimizer, 4)
    assert sorted(b.data_ptr() for b in prepared.buffers) == made  # the offloads made no buffer
    median = sorted(later)[1]
    assert first <= 1.5 * median, f"first offload {first:.3f} s, later ones {later}"

    cold_model, cold_optimizer = _linear_trainer("cuda")
    _train_once(cold_model, cold_optimizer)
    cold = HostParking()
    cold_first, *cold_later = _offload_seconds(cold, cold_model, cold_optimizer, 4)
    assert cold_first > 2 * sorted(cold_later)[1], f"unprepared: {cold_first:.3f} s, then {cold_later}"
    print(
        f"prepared: first {first:.3f} s, later {later}; unprepared: first {cold_first:.3f}, later {cold_later}"
    )
