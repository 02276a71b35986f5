"""Megatron-Core's strategy on CPU ranks over gloo, for tests that check its parallel layouts against one
rank: the CUDA calls it makes with dropout 0 and CPU initialisation are pointed at the CPU.

Megatron-Core runs on CUDA only (the strategy refuses a CPU device); what is patched here is where it
asks for a CUDA device, seed, RNG tracker or side stream (and, for the all-to-all token dispatcher
under TP x EP, NCCL's uneven all-gather and reduce-scatter, which gloo lacks), not what it computes:
the same layers, collectives and optimizer run. ``run_ranks`` starts ``world_size`` spawned ranks of
``rank_fn`` (a module function, so it imports in the child) and returns what each saved.
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
    torch.cuda.synchronize = lambda *a, **k: None  # the pipeline schedule's point-to-point exchanges
    # the all-to-all token dispatcher (expert_parallel > 1) copies its split sizes to the host on a side
    # stream and waits for them: on the CPU one stream, the copies already done
    stream = _HostStream()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    from megatron.core.transformer.moe import token_dispatcher

    def host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        """``maybe_move_tensor_to_cpu``: the split sizes as the host arrays it makes of CUDA tensors."""
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = host_copy
    _uneven_collectives_over_gloo()
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


def _uneven_collectives_over_gloo() -> None:
    """Gloo's ``all_gather`` and ``reduce_scatter`` take parts of one size; NCCL's take uneven ones, which
    the all-to-all dispatcher under TP x EP gives (each rank's count of tokens for its experts). Here
    uneven parts go through the even collectives: gathered padded to the largest and cut, or summed whole
    and this rank's part kept (the same values: sums over the same ranks)."""
    import torch.distributed as dist

    gather, plain_reduce_scatter = dist.all_gather, dist.reduce_scatter

    def all_gather(
        parts: list[torch.Tensor], x: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        if all(p.shape == x.shape for p in parts):
            return gather(parts, x, group=group, async_op=async_op)
        padded = x.new_zeros((max(p.shape[0] for p in parts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        whole = [torch.empty_like(padded) for _ in parts]
        gather(whole, padded, group=group)
        for out, got in zip(parts, whole):
            out.copy_(got[: out.shape[0]])
        return None

    def reduce_scatter(
        out: torch.Tensor, parts: list[torch.Tensor], op: Any = dist.ReduceOp.SUM, group: Any = None,
        async_op: bool = False,
    ) -> Any:  # fmt: skip
        if all(p.shape == out.shape for p in parts):
            return plain_reduce_scatter(out, parts, op=op, group=group, async_op=async_op)
        whole = torch.cat([p.reshape(-1) for p in parts])
        dist.all_reduce(whole, op=op, group=group)
        rank = dist.get_rank(group)
        start = sum(p.numel() for p in parts[:rank])
        out.copy_(whole[start : start + out.numel()].view_as(out))
        return None

    dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter


class _HostStream:
    """A CUDA stream's calls the all-to-all dispatcher makes, on the CPU (where work is in order)."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self) -> Any:
        return types.SimpleNamespace(synchronize=lambda: None)


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
