"""Weights from actor_train to actor_infer in buckets of a set size, so the engine's extra memory is one bucket.

Three transports (``rollout.weight_sync_transport``): through Ray's object store (host memory); when
every engine worker sits on a device of actor_train's, as handles to buffers each trainer rank shares
with the engine worker on its own device (``reroll.runtime.shared_buckets``: CUDA IPC on GPUs, POSIX
shared memory on CPUs; nothing crosses Ray but a few hundred bytes of handle per bucket); or, when the
engine sits on other devices, broadcast from actor_train rank 0 to every engine through a process
group of their own (``BroadcastGroup``: NCCL on GPUs, gloo on CPUs), only each bucket's
``BucketLayout`` (names, dtypes, shapes, offsets) going through Ray.

A bucket holds whole decoder layers: vLLM fuses a layer's projections (q/k/v into ``qkv_proj``, gate/up
into ``gate_up_proj``) and reprocesses a fused layer from what one ``reload_weights`` call gave it, so
a bucket that held ``q_proj`` without ``k_proj`` would leave the rest of that layer uninitialised
(measured: NaN log-probs with one tensor per bucket, exact ones with one layer per bucket). A layer
larger than the bucket size travels alone, so the peak is ``max(bucket, largest layer)``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch

WeightBucket = list[tuple[str, torch.Tensor]]

_LAYER = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.self_attn.q_proj.weight" -> "model.layers.3"


def layer_key(name: str) -> str:
    """The unit a bucket never splits: the prefix up to the first layer index, or the name itself."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def split_into_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[WeightBucket]:
    """``named`` (in state-dict order) cut into buckets of at most ``bucket_bytes``, whole layers each.

    Consecutive names with the same ``layer_key`` stay in one bucket; a layer that alone exceeds
    ``bucket_bytes`` is a bucket of its own.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: WeightBucket = []
    size = 0
    for _, group in itertools.groupby(named, key=lambda item: layer_key(item[0])):
        layer = list(group)
        layer_size = sum(t.numel() * t.element_size() for _, t in layer)
        if bucket and size + layer_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(layer)
        size += layer_size
    if bucket:
        yield bucket


@dataclass(frozen=True)
class BucketLayout:
    """Where each weight of a bucket sits in one flat byte buffer: ``(name, dtype, shape, offset)``
    entries and the buffer's size. What a receiver needs to allocate the buffer and read it back."""

    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    nbytes: int


_ALIGN = 256  # every weight starts at a multiple of this many bytes, so its view is aligned


def bucket_layout(bucket: WeightBucket, dtype: torch.dtype) -> BucketLayout:
    """Where each weight of ``bucket``, cast to ``dtype`` (the engine's), sits in one flat byte buffer."""
    entries, offset = [], 0
    for name, t in bucket:
        entries.append((name, str(dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * dtype.itemsize // _ALIGN) * _ALIGN
    return BucketLayout(tuple(entries), offset)


def pack_into(flat: torch.Tensor, bucket: WeightBucket, layout: BucketLayout) -> None:
    """Copy ``bucket`` into ``flat`` (uint8, ``layout.nbytes`` long) as ``layout`` places it."""
    for (_, t), (_, dtype_name, _, start) in zip(bucket, layout.entries):
        dtype = getattr(torch, dtype_name)
        n = t.numel() * dtype.itemsize
        flat[start : start + n].view(dtype).copy_(t.detach().reshape(-1))


def pack_bucket(
    bucket: WeightBucket, dtype: torch.dtype, device: torch.device | str | None = None
) -> tuple[BucketLayout, torch.Tensor]:
    """``bucket`` copied into one flat uint8 buffer on ``device`` (default: the first tensor's), each
    weight cast to ``dtype`` (the engine's): its layout, and the buffer."""
    layout = bucket_layout(bucket, dtype)
    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device or bucket[0][1].device)
    pack_into(flat, bucket, layout)
    return layout, flat


def unpack_bucket(
    flat: torch.Tensor, entries: Iterable[tuple[str, str, tuple[int, ...], int]]
) -> WeightBucket:
    """The weights of a flat buffer laid out by ``pack_bucket``, as views of it (no copy)."""
    out = []
    for name, dtype_name, shape, start in entries:
        dtype = getattr(torch, dtype_name)
        n = math.prod(shape) * dtype.itemsize
        out.append((name, flat[start : start + n].view(dtype).view(shape)))
    return out


class BroadcastGroup:
    """A ``torch.distributed`` process group of its own between actor_train rank 0 (rank 0 here, the
    source) and every actor_infer worker (ranks 1..n), for weight sync over the ``collective`` transport.

    It is not the default process group (a trainer's ranks use that among themselves): its members meet
    through a ``TCPStore`` that rank 0 hosts at ``address``, and the group is built on that store alone
    (the approach verl and OpenRLHF take for their weight-update groups). ``backend`` 'nccl' broadcasts
    buffers on each member's current CUDA device, 'gloo' CPU buffers. Forming it and every broadcast are
    bounded by ``timeout_s``: a member that dies makes its peers' broadcast raise at once (the
    connection drops), one that stops answering makes it raise after ``timeout_s``; never a hang.
    """

    def __init__(self, address: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        host, port = address.rsplit(":", 1)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.bytes = 0  # bytes broadcast (rank 0) or received (the others) since it was formed
        self._store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=self.timeout)
        store = dist.PrefixStore("reroll-weight-sync", self._store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._group = dist.ProcessGroupNCCL(store, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._group = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
            self.device = torch.device("cpu")
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device))  # every member is there
        self.bytes = 0

    def broadcast(self, flat: torch.Tensor) -> None:
        """Rank 0's ``flat`` into every member's ``flat`` (same size, on ``self.device``); returns once
        this member's part is done (a receiver's buffer then holds the data)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, self.timeout
        self._group.broadcast([flat], options).wait(self.timeout)
        self.bytes += flat.numel() * flat.element_size()

    def close(self) -> None:
        """Leave the group (its peers' next broadcast fails); the store closes with rank 0's."""
        with contextlib.suppress(AttributeError, RuntimeError):  # no shutdown, or already broken
            self._group.shutdown()
