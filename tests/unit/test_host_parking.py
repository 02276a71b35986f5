"""``HostParking`` off CUDA: host buffers page-locked ahead of the first offload (``prepare``), an offload
that waits for a preparation under way, nothing pinned where the run will not offload, and a round trip
that gives back exactly what went out. Page-locking is a fake here (no CUDA): the buffers' structure
and the lock calls are what is checked; ``tests/gpu/test_pinned_offload_cuda.py`` times the real one."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from reroll.config.placement import PARKING_MARGIN, may_park
from reroll.strategies.host_parking import HostParking
from tests.conftest import small_config


class FakeGPUParking(HostParking):
    """``HostParking`` as on a GPU, with the model's CPU tensors standing in for device tensors: a tensor
    is "on the host" once it is one of the parking's buffers, and a reload makes a fresh tensor; the
    page-locking records its calls and takes ``lock_s`` each (a slow driver)."""

    def __init__(self, lock_s: float = 0.0) -> None:
        self.locks: list[int] = []
        self.lock_threads: set[str] = set()
        super().__init__(register=self._fake_register, unregister=lambda address: None)
        self.lock_s = lock_s

    def _fake_register(self, address: int, nbytes: int) -> int:
        time.sleep(self.lock_s)
        self.locks.append(address)
        self.lock_threads.add(threading.current_thread().name)
        return 0

    def _on_host(self, t: torch.Tensor) -> bool:
        return any(t.data_ptr() == b.data_ptr() for b in self.buffers)

    def _to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.clone()


def _trainer(seed: int = 0, amsgrad: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model.register_buffer("scale", torch.ones(4))
    model.register_buffer("none", torch.zeros(0))  # empty tensors have no address to tell buffers by
    model.register_buffer("none_either", torch.zeros(0, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=amsgrad)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.arange(24.0).reshape(3, 8) / 24
    (model(x) * model.scale).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return [t for t in (*model.parameters(), *model.buffers(), *moments) if t.numel()]


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamws_moments_are_predicted_before_its_first_step(amsgrad):
    """The shapes prepared before the first step (parameters, buffers, the moments AdamW will make) are
    those the offloads after it park: torch's AdamW makes each moment like its parameter."""
    model, optimizer = _trainer(amsgrad=amsgrad)
    parking = FakeGPUParking()
    before = parking.parked_shapes(model, optimizer)
    _step(model, optimizer)
    after = parking.parked_shapes(model, optimizer)
    assert sorted(map(str, before)) == sorted(map(str, after))
    params, buffers = len(list(model.parameters())), 1  # ``scale``; the empty ones need no buffer
    assert len(after) == params * (4 if amsgrad else 3) + buffers  # checks the test reached the state


def test_prepared_buffers_exist_before_the_first_offload_which_only_copies():
    model, optimizer = _trainer()
    parking = FakeGPUParking()
    parking.prepare_for(model, optimizer, torch.device("cpu"), worth_it=lambda nbytes: True)
    parking.wait_prepared()
    made, locks = [b.data_ptr() for b in parking.buffers], list(parking.locks)
    assert len(made) == len(parking.parked_shapes(model, optimizer)) == len(locks) > 0
    assert parking.lock_threads == {"host-parking-prepare"}  # pinned off the caller's thread
    _step(model, optimizer)  # the moments exist now
    parking.offload(model, optimizer)
    assert [b.data_ptr() for b in parking.buffers] == made and parking.locks == locks  # nothing new
    parked = _state(model, optimizer)
    assert sorted(t.data_ptr() for t in parked) == sorted(made)  # every tensor in a prepared buffer
    assert parking.pinned_bytes == sum(t.numel() * t.element_size() for t in parked)


def test_an_offload_waits_for_a_slow_preparation():
    """Started just before the offload, a preparation that takes a while: the offload waits for it and
    uses its buffers (without the wait it would make its own beside them: more buffers and locks)."""
    model, optimizer = _trainer()
    _step(model, optimizer)
    parking = FakeGPUParking(lock_s=0.02)
    want = len(parking.parked_shapes(model, optimizer))
    start = time.perf_counter()
    parking.prepare_for(model, optimizer, torch.device("cpu"), worth_it=lambda nbytes: True)
    assert time.perf_counter() - start < want * 0.02 / 2  # prepare returned before pinning was done
    parking.offload(model, optimizer)
    assert len(parking.locks) == len(parking.buffers) == want
    assert parking.lock_threads == {"host-parking-prepare"}
    assert {t.data_ptr() for t in _state(model, optimizer)} == {b.data_ptr() for b in parking.buffers}


def test_preparations_in_a_row_add_only_what_is_missing():
    """Asked again (each optimizer step asks) while or after a preparation runs: nothing doubles."""
    model, optimizer = _trainer()
    parking = FakeGPUParking(lock_s=0.005)
    for _ in range(3):
        parking.prepare_for(model, optimizer, torch.device("cpu"), worth_it=lambda nbytes: True)
    parking.wait_prepared()
    assert len(parking.buffers) == len(parking.parked_shapes(model, optimizer)) == len(parking.locks)


def test_nothing_is_prepared_where_the_state_will_not_be_parked():
    model, optimizer = _trainer()
    parking, asked = FakeGPUParking(), []
    parking.prepare_for(model, optimizer, torch.device("cpu"), worth_it=lambda nbytes: asked.append(nbytes))
    parking.wait_prepared()
    assert asked == [sum(t.numel() * t.element_size() for t in model.parameters()) * 3 + 16]
    assert parking.buffers == [] and parking.locks == [] and parking._preparing is None


def test_a_round_trip_gives_back_every_bit_and_training_goes_on_as_without_it():
    moved, stayed = _trainer(), _trainer()
    parking = FakeGPUParking()
    parking.prepare_for(*moved, torch.device("cpu"), worth_it=lambda nbytes: True)
    for _ in range(2):
        _step(*moved)
        _step(*stayed)
        want = [t.clone() for t in _state(*moved)]
        parking.offload(*moved)
        parking.reload(*moved, torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(_state(*moved), want, strict=True))
        assert not any(parking._on_host(t) for t in _state(*moved))  # fresh tensors, not the buffers
    _step(*moved)
    _step(*stayed)
    assert all(torch.equal(a, b) for a, b in zip(_state(*moved), _state(*stayed), strict=True))


def test_a_buffer_holding_a_parked_tensor_is_never_taken_by_another():
    """Two trainers of one shape parked by one parking without a reload between: the second makes its
    own buffers, the first's values stay as they were; after both reloads their buffers are free again."""
    a, b = _trainer(seed=0), _trainer(seed=1)
    for trainer in (a, b):
        _step(*trainer)
    want = [t.clone() for t in _state(*a)]
    parking = FakeGPUParking()
    parking.offload(*a)
    parking.offload(*b)
    assert len(parking.buffers) == 2 * len(want)
    assert all(torch.equal(x, y) for x, y in zip(_state(*a), want, strict=True))
    parking.reload(*a, torch.device("cpu"))
    parking.reload(*b, torch.device("cpu"))
    parking.offload(*a)
    parking.reload(*a, torch.device("cpu"))
    parking.offload(*a)
    assert len(parking.buffers) == 2 * len(want) and parking._held  # reused, nothing new
    assert all(torch.equal(x, y) for x, y in zip(_state(*a), want, strict=True))


def test_a_failed_preparation_is_said_and_the_offload_makes_its_buffers_itself(caplog):
    model, optimizer = _trainer()
    _step(model, optimizer)
    parking, want = FakeGPUParking(), [t.clone() for t in _state(model, optimizer)]
    register = parking._register

    def refuse(address: int, nbytes: int) -> int:
        raise OSError("out of host memory")

    parking._register = refuse
    parking.prepare_for(model, optimizer, torch.device("cpu"), worth_it=lambda nbytes: True)
    parking.wait_prepared()
    assert parking.buffers == []  # the thread ran and failed at its first lock
    parking._register = register
    parking.offload(model, optimizer)
    assert "preparing host buffers for offload failed (OSError: out of host memory)" in caplog.text
    assert len(parking.buffers) == len(parking.locks) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(_state(model, optimizer), want, strict=True))


def _cfg(tmp_path, offload: str, **overrides):
    base = {
        "placement.devices": 1,
        "placement.device_type": "cuda",
        "placement.offload": offload,
        "rollout.engine": "vllm",
        "rollout.vllm.gpu_memory_utilization": 0.35,
    }
    return small_config(tmp_path, *(f"{k}={v}" for k, v in (base | overrides).items()))


def test_buffers_are_prepared_only_where_the_state_is_likely_to_be_parked(tmp_path):
    """``may_park``: never under 'never' or where nothing else shares the GPU; always under 'always';
    under 'auto' where the state, with the allocator's margin, would not stay beside the engine (two
    trainer roles and a 0.35 share of an 80 GB card leave 23.4 GB a role: the 3B row's 18.5 GB state
    did not stay on an H100, the 0.5B row's 3 GB did)."""
    total, gb = 85_000_000_000, 10**9  # an H100 80GB's bytes
    auto = _cfg(tmp_path, "auto")
    room = (0.9 - 0.35) * total / 2  # per trainer role (actor_train and reference share the GPU)
    assert may_park(auto, "actor_train", int(18.5 * gb), total)
    assert not may_park(auto, "actor_train", 3 * gb, total)
    assert may_park(auto, "actor_train", int(room / PARKING_MARGIN) + 1, total)
    assert not may_park(auto, "actor_train", int(room / PARKING_MARGIN) - 10**6, total)
    assert not may_park(_cfg(tmp_path, "never"), "actor_train", 60 * gb, total)
    assert may_park(_cfg(tmp_path, "always"), "reference", 1 * gb, total)
    alone = {"placement.devices": 3, "roles.reference.devices": "[1]", "roles.actor_infer.devices": "[2]"}
    assert not may_park(_cfg(tmp_path, "always", **alone), "actor_train", 60 * gb, total)
    hf = _cfg(tmp_path, "auto", **{"rollout.engine": "hf"})  # an engine of no fixed share: trainers move
    assert may_park(hf, "actor_train", 1 * gb, total)
