"""Weights from actor_train to actor_infer in buckets of a set size, so the engine's extra memory is one bucket.

Two transports (``rollout.weight_sync_transport``): through Ray's object store (host memory), or,
when the engine sits on the trainer's GPU, as CUDA IPC handles of device buffers (``share_bucket`` /
``open_bucket``: nothing crosses the host but a few hundred bytes of handle per bucket).

A bucket holds whole decoder layers: vLLM fuses a layer's projections (q/k/v into ``qkv_proj``, gate/up
into ``gate_up_proj``) and reprocesses a fused layer from what one ``reload_weights`` call gave it, so
a bucket that held ``q_proj`` without ``k_proj`` would leave the rest of that layer uninitialised
(measured: NaN log-probs with one tensor per bucket, exact ones with one layer per bucket). A layer
larger than the bucket size travels alone, so the peak is ``max(bucket, largest layer)``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

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
class SharedBucket:
    """A bucket of weights left on the trainer's GPU and shared through CUDA IPC: one flat byte buffer
    (``handle``: what ``torch.multiprocessing.reductions.reduce_tensor`` gives, to rebuild it in
    another process), where each weight sits at ``(name, dtype, shape, offset)``. ``device_uuid`` names
    the GPU, since two processes number their visible GPUs each their own way."""

    handle: tuple[Any, tuple[Any, ...]]
    device_uuid: str
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    nbytes: int


_ALIGN = 256  # every weight starts at a multiple of this many bytes, so its view is aligned


def share_bucket(bucket: WeightBucket, dtype: torch.dtype) -> tuple[SharedBucket, torch.Tensor]:
    """``bucket`` copied into one flat GPU buffer (in ``dtype``, the engine's) and shared: the handle to
    send, and the buffer, which the sender must keep alive until the receiver has loaded it."""
    entries, offset = [], 0
    for name, t in bucket:
        entries.append((name, str(dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * dtype.itemsize // _ALIGN) * _ALIGN
    device = bucket[0][1].device
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, t), (_, _, _, start) in zip(bucket, entries):
        n = t.numel() * dtype.itemsize
        flat[start : start + n].view(dtype).copy_(t.detach().reshape(-1))
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return SharedBucket(reduce_tensor(flat), uuid, tuple(entries), offset), flat


def open_bucket(shared: SharedBucket) -> WeightBucket:
    """The weights of a ``SharedBucket`` as views of the sender's buffer, opened on this process's
    index of the same GPU (raises if this process cannot see that GPU)."""
    index = next(
        (
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == shared.device_uuid
        ),
        None,
    )
    if index is None:
        raise RuntimeError(
            f"weight sync over cuda_ipc: GPU {shared.device_uuid} (actor_train rank 0's) is not visible in "
            "this process; set rollout.weight_sync_transport=object_store or place actor_infer on that GPU"
        )
    rebuild, args = shared.handle
    args = list(args)
    args[6] = index  # the device index in the receiving process
    flat = rebuild(*args)
    out = []
    for name, dtype_name, shape, start in shared.entries:
        dtype = getattr(torch, dtype_name)
        n = math.prod(shape) * dtype.itemsize
        out.append((name, flat[start : start + n].view(dtype).view(shape)))
    return out
