"""Moving a training step's tensors between the host and the GPU without making the host wait mid-step.

A plain ``tensor.to("cuda")`` of a CPU tensor and a ``float(cuda_tensor)`` each synchronise the host
with the GPU's queue (PyTorch's blocking copies end in ``cudaStreamSynchronize``): inside a micro-batch
loop the host then waits for every kernel queued so far before it may queue the next, and the GPU
idles while it does. ``to_device`` queues the copy from page-locked memory instead (the host goes on;
the stream orders the copy before the kernels that read it); ``scalars_to_host`` reads many scalars
(a step's metrics) in one copy, where each ``float`` would wait once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``. A CPU tensor bound for a GPU is copied into page-locked memory (PyTorch's
    caching host allocator, which keeps the buffer until the copy is done) and the copy to the GPU is
    queued without waiting; any other move is ``t.to(device)``."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def scalars_to_host(values: Sequence[torch.Tensor | float]) -> list[float]:
    """Each value as ``float(value)`` gives it, the tensors' (one element each) read in one copy per
    device (one host synchronisation, not one per tensor). Exact: every value is widened to float64
    on its device before the copy, as ``float`` widens it on the host."""
    out = [v if not isinstance(v, torch.Tensor) else 0.0 for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for where in by_device.values():
        stacked = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in where])  # type: ignore[union-attr]
        for i, x in zip(where, stacked.tolist(), strict=True):
            out[i] = x
    return [float(v) for v in out]


def metrics_to_host(parts: Sequence[dict[str, torch.Tensor | float]]) -> list[dict[str, float]]:
    """Micro-batches' metrics (device scalars or floats) as floats, all read in one ``scalars_to_host``."""
    keys = [(i, k) for i, p in enumerate(parts) for k in p]
    values = scalars_to_host([parts[i][k] for i, k in keys])
    out: list[dict[str, float]] = [{} for _ in parts]
    for (i, k), v in zip(keys, values, strict=True):
        out[i][k] = v
    return out
