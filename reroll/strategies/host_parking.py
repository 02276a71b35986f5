"""Where a strategy's state waits in host memory while a colocated role has the GPU (``HostParking``),
and the host buffers it needs, page-locked ahead of the first offload (``HostParking.prepare``)."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

logger = logging.getLogger(__name__)

Shape = tuple[tuple[int, ...], torch.dtype]  # a plain tensor's shape and dtype: what a host buffer fits
Register = Callable[[int, int], int]  # (address, bytes) -> a CUDA error code, 0 for success


class HostParking:
    """Where a strategy's state waits in host memory while a colocated role has the GPU.

    ``offload`` copies every parameter, gradient, buffer and Adam moment (not the step counters: a
    non-capturable AdamW wants them on the CPU, the fused one on the GPU, and they stay where they are)
    into pinned host memory and frees its GPU memory; ``reload`` copies them back into fresh GPU
    tensors. Every copy is queued without waiting and the move waits once, at its end: between pinned
    memory and the GPU a copy runs at the link's speed (about 53 GB/s each way on an H200 or H100,
    against 2-3 GB/s out and 6-9 GB/s back through pageable memory; ``benchmarks/offload.py``).

    Each tensor is parked in a host buffer of its exact shape and dtype, page-locked in place
    (``cudaHostRegister``) and kept for the run (pinning costs about ten copies): the run holds the
    state's size in pinned host memory. (``torch.empty(pin_memory=True)`` would round every buffer up to
    a power of two: 1.9x the state for the 0.5B shape.) Buffers are pooled by shape and dtype: an
    offloaded tensor takes a free buffer of its kind (one no parked tensor is in; ``reload`` frees it),
    so a tensor missing or added since (a moment made by the first step) takes or makes its own without
    disturbing the others'.

    ``prepare`` makes and page-locks the buffers of given shapes in a background thread, before they
    are needed, so that the first offload only copies (its pinning, seconds for a 3B trainer's state,
    would otherwise sit on the step's critical path). An offload waits for a preparation under way
    (one thread pins at a time: ``cudaHostRegister`` calls serialise in the driver anyway).

    A sharded tensor (FSDP2's DTensor) is parked in a host DTensor made once by ``.to("cpu")`` at its
    first offload (not prepared ahead), whose local shard is page-locked and copied into at later
    offloads (not ``DTensor.from_local`` around an own buffer: that moves the buffer back to the mesh's
    GPU). Off CUDA, or where page-locking is refused, plain moves.

    ``register``/``unregister``: the page-locking calls (CUDA's by default; a test's off CUDA)."""

    def __init__(
        self, register: Register | None = None, unregister: Callable[[int], Any] | None = None
    ) -> None:
        self._pool: dict[tuple, list[tuple[int, torch.Tensor]]] = {}  # (data_ptr, buffer) by ``_kind``
        self._held: set[int] = set()  # data_ptr of each buffer a parked tensor is in (a DTensor's shard's)
        self._locked: set[int] = set()  # data_ptr of each page-locked buffer (a DTensor's: its shard's)
        self._pin = register is not None or torch.cuda.is_available()
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._guard = threading.Lock()  # the pool, the pending count and ``_locked`` across threads
        self._pending: Counter[tuple] = Counter()  # buffers of each kind a preparation will add
        self._preparing: threading.Thread | None = None
        self._failed: Exception | None = None  # what stopped a preparation, said at the next wait

    def __del__(self) -> None:
        if not self._locked:
            return
        try:
            for buffer in self.buffers:
                self._unlock(buffer)
        except BaseException:
            # at interpreter exit CUDA may be gone already, and a Ray actor stopped by SIGTERM raises its
            # SystemExit in whatever runs, this too (the "Exception ignored in __del__" lines of the bench's
            # teardown): the OS unpins with the process
            pass

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every host buffer, by kind in the order made."""
        with self._guard:
            return [b for pool in self._pool.values() for _, b in pool]

    @property
    def pinned_bytes(self) -> int:
        """The bytes of this parking's page-locked buffers (a DTensor's: its local shard)."""
        return sum(_nbytes(_local(b)) for b in self.buffers if _local(b).data_ptr() in self._locked)

    def prepare(self, shapes: list[Shape], device: torch.device | None = None) -> None:
        """Make and page-lock, in a background thread, a buffer for each of ``shapes`` that the pool (with
        what earlier preparations will add) does not hold yet; returns at once. ``device``: the CUDA
        device whose context the pages are locked for (without an index: the caller's current one; a
        new thread's would be the first)."""
        with self._guard:
            have = Counter({kind: len(pool) for kind, pool in self._pool.items()})
            missing = Counter(_plain_kind(s) for s in shapes) - have
            missing -= self._pending
            if not missing:
                return
            if device is not None and device.type == "cuda" and device.index is None:  # the caller's
                device = torch.device("cuda", torch.cuda.current_device())
            self._pending += missing
            thread = threading.Thread(
                target=self._make,
                args=(missing, self._preparing, device),
                name="host-parking-prepare",
                daemon=True,  # an exit mid-way leaves nothing to undo: the OS unpins with the process
            )
            self._preparing = thread
            thread.start()  # under the guard: a wait that sees the thread can join it

    def wait_prepared(self) -> None:
        """Return once every preparation started has ended. One that failed is said (a warning): the
        offload then makes the buffers it still lacks itself, as without preparation."""
        thread = self._preparing
        if thread is not None:
            thread.join()
        failed, self._failed = self._failed, None
        if failed is not None:
            logger.warning(
                "preparing host buffers for offload failed (%s: %s): the offload makes them itself",
                type(failed).__name__,
                failed,
            )

    def prepare_for(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        worth_it: Callable[[int], bool],
    ) -> None:
        """``prepare`` the buffers ``offload`` will want for ``model`` and ``optimizer`` (``parked_shapes``),
        where ``worth_it`` of their bytes says the state is likely to be parked."""
        shapes = self.parked_shapes(model, optimizer)
        if shapes and worth_it(sum(_shape_bytes(s) for s in shapes)):
            self.prepare(shapes, device)

    def parked_shapes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Shape]:
        """The shape and dtype of each plain GPU tensor ``HostParking.offload`` moves for ``model`` and
        ``optimizer``: parameters, gradients, buffers, and the optimizer's state but its step counters; an
        Adam(W) parameter without state yet (before the first step) counts its moments as torch makes
        them, ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) each of the parameter's
        shape and dtype (a parameter that never gets a gradient leaves its two unused). Other optimizers'
        state is counted once it exists. Sharded tensors (DTensors), empty tensors and host tensors are
        left out: nothing to prepare for them."""
        tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
        tensors += list(model.buffers())
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state = optimizer.state.get(p)
                    if state:
                        tensors += [
                            v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"
                        ]
                    elif p.requires_grad and isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
                        tensors += [p] * (3 if group.get("amsgrad") else 2)
        kept = [t for t in tensors if not self._on_host(t) and not _is_dtensor(t) and t.numel()]
        return [(tuple(t.shape), t.dtype) for t in kept]

    def offload(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.wait_prepared()
        self._walk(model, optimizer, self._park)

    def reload(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
    ) -> None:
        self._walk(model, optimizer, partial(self._unpark, device=device))

    def park_storages(self, storages: list[torch.UntypedStorage]) -> list[Callable[[], None]]:
        """Each GPU storage copied into its host buffer and then freed in place, for state whose tensors
        must keep their identity (Megatron's DDP hooks sit on its parameters; its optimizer's shards are
        views): they stay the same objects and hold no GPU memory until the storage's returned
        callable brings it back. Storages off the GPU are left alone."""
        self.wait_prepared()
        gpu = [st for st in storages if st.device.type == "cuda" and st.nbytes()]
        hosts = [self._park(_bytes_of(st)) for st in gpu]
        if gpu:
            torch.cuda.synchronize()  # every queued copy done before the GPU memory goes
        restore = []
        for st, host in zip(gpu, hosts, strict=True):
            st.resize_(0)
            restore.append(partial(self._bring_back, st, host))
        return restore

    def _walk(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, move: Any) -> None:
        with torch.no_grad():
            model._apply(move)  # what Module.to does; FSDP2's modules re-register their shards after it
            for state in optimizer.state.values() if optimizer is not None else ():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = move(v)
        if torch.cuda.is_initialized():  # the queued copies done: host copies are read only after this
            torch.cuda.synchronize()

    def _park(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s host copy, queued into a free buffer of its kind (made now if none is free): one that
        holds no parked tensor now (a buffer is free again once its tensor is brought back)."""
        if self._on_host(t):
            return t
        if not _nbytes(_local(t)):  # nothing to copy or lock, and no address to tell its buffer by
            return t.to("cpu")
        kind = _kind(t)
        with self._guard:
            pool = self._pool.setdefault(kind, [])
            buffer = next((b for ptr, b in pool if ptr not in self._held), None)
        if buffer is None and _is_dtensor(t):  # a host DTensor of t's sharding (a copy), its shard locked
            buffer = t.to("cpu")
            self._lock(_local(buffer))
            self._add(kind, buffer)
        else:
            if buffer is None:  # locked first, so that even this first copy does not wait
                buffer = self._new_buffer((tuple(t.shape), t.dtype))
                self._add(kind, buffer)
            host = _local(buffer)
            host.copy_(_local(t), non_blocking=host.data_ptr() in self._locked)
        with self._guard:
            self._held.add(_local(buffer).data_ptr())
        return buffer

    def _unpark(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` queued back onto ``device``, its buffer (if it is one) free for the next offload."""
        with self._guard:
            self._held.discard(_local(t).data_ptr())
        return self._to_device(t, device)

    def _bring_back(self, storage: torch.UntypedStorage, host: torch.Tensor) -> None:
        """A storage ``park_storages`` freed, given its memory again and its bytes from ``host`` (queued: the
        GPU's later work on the stream runs after the copy), ``host`` free for the next offload."""
        storage.resize_(_nbytes(host))
        _bytes_of(storage).copy_(host, non_blocking=host.data_ptr() in self._locked)
        with self._guard:
            self._held.discard(host.data_ptr())

    def _add(self, kind: tuple, buffer: torch.Tensor) -> None:
        with self._guard:
            self._pool.setdefault(kind, []).append((_local(buffer).data_ptr(), buffer))

    def _make(
        self, missing: Counter[tuple], before: threading.Thread | None, device: torch.device | None
    ) -> None:
        """The preparation thread: after the one ``before`` it, a locked buffer of each missing kind."""
        if before is not None:
            before.join()
        made: Counter[tuple] = Counter()
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # the pages are locked for this device's context
            for kind, count in missing.items():
                for _ in range(count):
                    buffer = self._new_buffer(kind[1])
                    self._add(kind, buffer)
                    with self._guard:
                        self._pending[kind] -= 1
                        made[kind] += 1
        except Exception as e:  # said at the next offload's wait
            self._failed = e
        finally:
            with self._guard:  # what this thread did not make is no longer promised
                self._pending.subtract(missing - made)
                self._pending = +self._pending

    def _new_buffer(self, shape: Shape) -> torch.Tensor:
        buffer = torch.empty(shape[0], dtype=shape[1])
        self._lock(buffer)
        return buffer

    def _on_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in host memory already (nothing to park). A seam for tests off CUDA."""
        return t.device.type == "cpu"

    def _to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` queued back onto ``device``. A seam for tests off CUDA."""
        return t.to(device, non_blocking=True)

    def _lock(self, host: torch.Tensor) -> None:
        if not (self._pin and _nbytes(host)):
            return
        error = int(self._register(host.data_ptr(), _nbytes(host)))
        with self._guard:
            if error == 0:
                self._locked.add(host.data_ptr())
                return
            if not self._pin:
                return
            self._pin = False
        # page-locking refused (a memlock limit): plain copies still work
        logger.warning("page-locking host memory failed (cudaError %d): offload copies wait", error)

    def _unlock(self, buffer: torch.Tensor) -> None:
        host = _local(buffer)
        if host.data_ptr() in self._locked:
            self._locked.discard(host.data_ptr())
            self._unregister(host.data_ptr())


def _cuda_register(address: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))


def _cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _kind(t: torch.Tensor) -> tuple:
    """What a host buffer must match to take ``t``: its shape and dtype, and for a DTensor its sharding and
    local shape too."""
    if not _is_dtensor(t):
        return _plain_kind((tuple(t.shape), t.dtype))
    return ("dtensor", tuple(t.shape), t.dtype, tuple(t.placements), tuple(_local(t).shape))


def _plain_kind(shape: Shape) -> tuple:
    return ("plain", shape)


def _shape_bytes(shape: Shape) -> int:
    numel = 1
    for n in shape[0]:
        numel *= n
    return numel * shape[1].itemsize


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole of ``storage`` as a tensor of bytes (sharing it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
