"""The 'ipc' weight-sync transport: each trainer rank hands the engine worker on its own device a
handle to every bucket, never the bytes.

A trainer rank (``BucketSharer``) packs a bucket of the full weights (a sharded strategy all-gathers
them on every rank) into one flat buffer on its device, in the engine's dtype, and sends a
``SharedBucket``: the bucket's ``BucketLayout``, the pool device, and a handle to the buffer. On GPUs
the handle is CUDA IPC (``torch.multiprocessing.reductions.reduce_tensor``) and names the GPU by its
uuid, since two processes number their visible GPUs each their own way; on CPUs it is the name of a
POSIX shared-memory segment (``multiprocessing.shared_memory``). The engine worker on that device
opens it (``open_shared``: views of the sender's buffer, no copy), loads the views with its own weight
loader (vLLM's takes its tensor-parallel slice of each full tensor) and lets go of them; the sender
frees the buffer once the driver says the load is done (``BucketSharer.release``).

Only the handles cross Ray: a few hundred bytes per bucket and device.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

from reroll.runtime.weight_sync import BucketLayout, WeightBucket, bucket_layout, pack_into, unpack_bucket


@dataclass(frozen=True)
class SharedBucket:
    """A bucket in one flat buffer on the pool device ``device``, shared by handle: on GPUs ``cuda``
    (what ``reduce_tensor`` gives, to rebuild it in another process) on the GPU ``device_uuid``; on
    CPUs the shared-memory segment ``shm``."""

    layout: BucketLayout
    device: int
    shm: str | None = None
    cuda: tuple[Any, tuple[Any, ...]] | None = None
    device_uuid: str = ""


def gpu_uuid(index: int) -> str:
    """The uuid of this process's CUDA device ``index``."""
    return str(torch.cuda.get_device_properties(index).uuid)


class BucketSharer:
    """A trainer rank's side: buckets packed into shared buffers on its device (``on``), each kept
    alive until ``release`` (the engine worker has loaded it). ``device``: the rank's pool device,
    which names the engine worker that opens them."""

    def __init__(self, device: int, on: torch.device) -> None:
        self.device, self.on = device, on
        self._held: list[tuple[torch.Tensor, shared_memory.SharedMemory | None]] = []
        self.bytes = 0  # bytes shared since the sharer was made

    def share(self, bucket: WeightBucket, dtype: torch.dtype) -> SharedBucket:
        """``bucket`` (each weight cast to ``dtype``) in a new shared buffer: the handle to send."""
        layout = bucket_layout(bucket, dtype)
        self.bytes += layout.nbytes
        if self.on.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.on)
            pack_into(flat, bucket, layout)
            self._held.append((flat, None))
            return SharedBucket(
                layout, self.device, cuda=reduce_tensor(flat), device_uuid=gpu_uuid(flat.device.index)
            )
        segment = shared_memory.SharedMemory(create=True, size=max(layout.nbytes, 1))
        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=layout.nbytes)
        pack_into(flat, bucket, layout)
        self._held.append((flat, segment))
        return SharedBucket(layout, self.device, shm=segment.name)

    @property
    def held(self) -> int:
        """Buffers shared and not yet released."""
        return len(self._held)

    def release(self, keep: int = 0) -> None:
        """Free every buffer but the ``keep`` most recent (their loads may still run)."""
        freed = len(self._held) > keep
        while len(self._held) > keep:
            flat, segment = self._held.pop(0)
            del flat  # the tensor's hold on the segment's memory, before it closes
            if segment is not None:
                segment.close()
                segment.unlink()
        if freed and self.on.type == "cuda":
            torch.cuda.ipc_collect()  # blocks the receivers have let go of go back to the allocator


@contextlib.contextmanager
def open_shared(shared: SharedBucket) -> Iterator[WeightBucket]:
    """The weights of ``shared`` as views of the sender's buffer, valid inside the ``with`` (the list is
    emptied at its end, so no view outlives the mapping). On GPUs the buffer must be on this process's
    current device: an engine worker opens its own device's bucket."""
    if shared.cuda is not None:
        views = unpack_bucket(_open_cuda(shared), shared.layout.entries)
        try:
            yield views
        finally:
            views.clear()
        return
    if shared.shm is None:
        raise ValueError("a SharedBucket with neither a CUDA handle nor a shared-memory segment")
    segment = _attach(shared.shm, shared.layout.nbytes)
    flat = torch.frombuffer(segment, dtype=torch.uint8, count=shared.layout.nbytes)
    views = unpack_bucket(flat, shared.layout.entries)
    try:
        yield views
    finally:
        views.clear()
        del flat
        with contextlib.suppress(BufferError):  # a view kept by the loader: closed when it is collected
            segment.close()


def _attach(name: str, nbytes: int) -> mmap.mmap:
    """Map the segment ``name`` (the first ``nbytes`` of it) without ``SharedMemory``, whose resource
    tracker would take it over (before Python 3.13) and unlink it when this process exits: the sender
    owns it and frees it."""
    import _posixshmem

    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)


def _open_cuda(shared: SharedBucket) -> torch.Tensor:
    """The sender's GPU buffer, opened on this process's index of its GPU, which must be the current one."""
    assert shared.cuda is not None
    index = next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == shared.device_uuid), None)
    current = torch.cuda.current_device()
    if index != current:
        seen = "not visible in this process" if index is None else f"this process's cuda:{index}"
        raise RuntimeError(
            f"weight sync over ipc: the bucket of pool device {shared.device} is on GPU "
            f"{shared.device_uuid} ({seen}), but this engine worker runs on cuda:{current} "
            f"({gpu_uuid(current)}): the engine's devices and the trainer ranks' disagree; set "
            "rollout.weight_sync_transport=object_store and report the placement (reroll plan)"
        )
    rebuild, args = shared.cuda
    args = list(args)
    args[6] = index  # the device index in the receiving process
    return rebuild(*args)
