"""The peak memory a training step reached, for ``<role>/peak_memory_gb``, on a GPU how often the
allocator ran short (``<role>/alloc_retries``), and the most it ever held (whether the engine may stay
awake beside the trainers, ``placement.offload: auto``)."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory since the last call, in GiB: allocated tensor memory on a GPU (the counter is reset
    here), the process's peak resident set on a CPU (``ru_maxrss``: since the process started)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        reserved_peak(device)  # keep the reserved peak the reset below clears
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def reserved_peak(device: torch.device) -> int:
    """The most memory this process's allocator has held on ``device`` since it started (bytes): what it
    took from the GPU, cached blocks included, across ``peak_memory_gb``'s resets."""
    peak = max(_RESERVED_PEAK.get(device.index, 0), torch.cuda.max_memory_reserved(device))
    _RESERVED_PEAK[device.index] = peak
    return peak


def alloc_retries(device: torch.device) -> dict[str, float]:
    """On a GPU, ``{"alloc_retries": n}``: how many times since the last call the caching allocator found
    no free block, freed its whole cache and asked CUDA again (each one synchronises the device: a step
    that slows down with retries > 0 is short of memory; lower the micro-batch or the engine's share).
    Nothing on a CPU."""
    if device.type != "cuda":
        return {}
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    seen = _RETRIES_SEEN.get(device.index, 0)
    _RETRIES_SEEN[device.index] = retries
    return {"alloc_retries": float(retries - seen)}


_RETRIES_SEEN: dict[int | None, int] = {}
_RESERVED_PEAK: dict[int | None, int] = {}
