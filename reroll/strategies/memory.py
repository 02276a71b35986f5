"""The peak memory a training step reached, for ``<role>/peak_memory_gb``."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory since the last call, in GiB: allocated tensor memory on a GPU (the counter is reset
    here), the process's peak resident set on a CPU (``ru_maxrss``: since the process started)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)
