"""Weights from actor_train to actor_infer in buckets of a set size, so the engine's extra memory is one bucket.

A bucket holds whole decoder layers: vLLM fuses a layer's projections (q/k/v into ``qkv_proj``, gate/up
into ``gate_up_proj``) and reprocesses a fused layer from what one ``reload_weights`` call gave it, so
a bucket that held ``q_proj`` without ``k_proj`` would leave the rest of that layer uninitialised
(measured: NaN log-probs with one tensor per bucket, exact ones with one layer per bucket). A layer
larger than the bucket size travels alone, so the peak is ``max(bucket, largest layer)``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator

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
