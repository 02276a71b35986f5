"""Megatron-Core's strategy on CPU ranks over gloo, for tests that check its parallel layouts against one
rank: the CUDA calls it makes with dropout 0 and CPU initialisation are pointed at the CPU.

Megatron-Core runs on CUDA only (the strategy refuses a CPU device); what is patched here is where it
asks for a CUDA device, seed or RNG tracker, not what it computes: the same layers, collectives and
optimizer run. ``run_ranks`` starts ``world_size`` spawned ranks of ``rank_fn`` (a module function, so it
imports in the child) and returns what each saved.
"""

from __future__ import annotations

import contextlib
import socket
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def patch_cuda_for_cpu() -> None:
    """Point megatron-core's CUDA-only calls at the CPU in this process (spawned test ranks only)."""
    from megatron.core import tensor_parallel

    import reroll.strategies.megatron as strategy

    strategy._check_device = lambda device: None
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None
    no_fork = types.SimpleNamespace(fork=contextlib.nullcontext)
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: no_fork
    torch.cuda.current_device = lambda: "cpu"  # DDP's buffers
    torch.Tensor.cuda = lambda self, *a, **k: self  # a tied embedding's copy summed across stages at init
    plain_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # the optimizer's dtype check
        kind = plain_type(self, *args, **kwargs)
        return (
            kind.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) and "cuda" not in kind else kind
        )

    torch.Tensor.type = cuda_type
    # the factories torch.device("meta") redirects, listed (and cached) before ours replace them: a meta
    # model (the export's) would otherwise be built in host memory
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in ("tensor", "zeros", "empty", "ones", "full"):  # the optimizer's flags, device="cuda"
        setattr(torch, name, _on_cpu(getattr(torch, name)))


def patch_cuda_streams_for_cpu() -> None:
    """Give megatron-core's expert-parallel token dispatcher (all-to-all) the one CUDA stream it copies
    its split sizes to the host on, as a stand-in: on the CPU every copy is done when it returns."""

    class Stream:
        def wait_stream(self, other: Any) -> None:
            pass

        def record_event(self) -> Any:
            return types.SimpleNamespace(synchronize=lambda: None)

    stream = Stream()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream  # the same: no record_stream on a side stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    from megatron.core.transformer.moe import token_dispatcher

    host_copy = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        """The split sizes as numpy, as a CUDA tensor's copy gives them (all-to-all takes no tensor)."""
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return host_copy(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "cpu")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


def free_address() -> str:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{so.getsockname()[1]}"


def run_ranks(rank_fn: Callable[..., None], world_size: int, out: Path, *args: Any) -> list[Any]:
    """``rank_fn(rank, world_size, address, out, *args)`` in ``world_size`` spawned processes, each saving
    ``out/rank{rank}.pt``; their contents by rank."""
    import torch.multiprocessing as mp

    mp.start_processes(
        rank_fn, args=(world_size, free_address(), str(out), *args), nprocs=world_size, start_method="spawn"
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
