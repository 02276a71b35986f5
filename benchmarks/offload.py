"""What a colocated trainer's offload and reload cost: its state to host memory and back, per way of moving.

    python benchmarks/offload.py                       # Qwen2.5-0.5B shape, bf16, GPU
    python benchmarks/offload.py --model-size 3b       # and the 3B shape
    python benchmarks/offload.py --tiny --device cpu   # a smoke run (nothing moves on a CPU)

A Qwen2.5-shaped model with random init (nothing downloaded) under AdamW, after one training step so the
optimizer holds its moments: the state ``placement.offload`` moves when a trainer gives its GPU to the
engine. Timed, each move ended by a device synchronisation, mean of ``--repeat`` after the first:

- ``pageable``: ``Module.to`` and the moments moved one by one, what the torch and fsdp2 strategies
  did before 2026-12-05: each copy lands in pageable host memory and returns when done;
- ``pinned``: ``reroll.strategies.host_parking.HostParking`` made at the first offload: a pinned host
  buffer of its exact size per tensor (the first offload pays for pinning: its own column), reused,
  copies queued without waiting and waited for once;
- ``prepared``: the same, its buffers made and pinned ahead by ``HostParking.prepare`` in a background
  thread (started on the fresh model, AdamW's moments predicted, before its training step: what the
  workers do where ``may_park`` says the state will move); ``prepare s`` is that thread's seconds,
  waited for here before the step (in a run they overlap step 1), so the first offload only copies;
- ``non-blocking``: the pageable moves with ``non_blocking=True``, so torch's caching host allocator
  pins the host copies (each rounded up to a power of two) and reuses them (FSDP2's sharded tensors
  move this way).

Prints one row per shape and way: GiB moved, the preparation's seconds, the first offload's and the
later ones' seconds and their ratio, GB/s each way, and the pinned host memory the way holds between
moves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import QWEN25_05B, QWEN25_3B, TINY, device_name, qwen2_config  # noqa: E402
from reroll.strategies.host_parking import HostParking  # noqa: E402


def fresh_model(
    shape: dict, device: str, dtype: torch.dtype
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its AdamW before any step (no moments yet)."""
    from transformers import Qwen2ForCausalLM

    cfg = qwen2_config(shape, 151936)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6)


def train_once(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str) -> None:
    """One AdamW step (its moments made), gradients dropped as the trainer drops them."""
    ids = torch.randint(0, 1000, (1, 16), device=device)
    model(input_ids=ids).logits.float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(fn: Callable[[], None], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def to_moves(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, non_blocking: bool
):
    """``Module.to`` and the moments one by one; ``non_blocking``: queued, so torch pins the host copies."""

    def move(to: torch.device) -> None:
        model.to(to, non_blocking=non_blocking)
        for state in optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(to, non_blocking=non_blocking)
        if non_blocking and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    held = torch_pinned_bytes if non_blocking else lambda: 0
    return lambda: move(torch.device("cpu")), lambda: move(device), held


def pinned_moves(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, parked: HostParking
):
    offload = lambda: parked.offload(model, optimizer)  # noqa: E731
    reload = lambda: parked.reload(model, optimizer, device)  # noqa: E731
    return offload, reload, lambda: parked.pinned_bytes + torch_pinned_bytes()


def torch_pinned_bytes() -> int:
    """What torch's caching host allocator holds pinned (emptied before each row)."""
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


def measure(args: argparse.Namespace, size: str, way: str) -> dict:
    shape = TINY if args.tiny else {"0.5b": QWEN25_05B, "3b": QWEN25_3B}[size]
    model, optimizer = fresh_model(shape, args.device, getattr(torch, args.dtype))
    device = torch.device(args.device)
    parked, prepare = HostParking(), None
    if way == "prepared":  # as a worker does once its optimizer exists, before the first step
        start = time.perf_counter()
        parked.prepare_for(model, optimizer, device, worth_it=lambda nbytes: True)
        parked.wait_prepared()
        prepare = time.perf_counter() - start
    train_once(model, optimizer, args.device)
    moved = state_bytes(model, optimizer)
    if way in ("pinned", "prepared"):
        offload, reload, pinned_bytes = pinned_moves(model, optimizer, device, parked)
    else:
        offload, reload, pinned_bytes = to_moves(model, optimizer, device, non_blocking=way == "non-blocking")
    first = timed(offload, args.device)
    timed(reload, args.device)
    outs, ins = [], []
    for _ in range(args.repeat):
        outs.append(timed(offload, args.device))
        if args.device == "cuda":
            torch.cuda.empty_cache()
            assert torch.cuda.memory_allocated() < 0.05 * moved, "state left on the GPU after offload"
        ins.append(timed(reload, args.device))
    pinned = pinned_bytes() if args.device == "cuda" else 0
    del model, optimizer, offload, reload, pinned_bytes, parked
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()  # the next row starts with no pinned blocks cached
    out, into = statistics.mean(outs), statistics.mean(ins)
    return {
        "size": size,
        "way": way,
        "gib": moved / 2**30,
        "prepare": prepare,
        "first": first,
        "out": out,
        "in": into,
        "bytes": moved,
        "pinned": pinned / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--model-size", default="0.5b", choices=["0.5b", "3b"], help="3b: the 0.5B row, then 3B"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a two-layer model (a smoke run)")
    args = parser.parse_args()
    sizes = ["0.5b", "3b"] if args.model_size == "3b" and not args.tiny else ["0.5b"]
    print(f"# offload and reload of a trainer's state, {device_name(args.device)}, {args.dtype}", flush=True)
    print(
        "| shape | way | GiB | prepare s | first offload s | offload s | first / later | GB/s | reload s "
        "| GB/s | pinned GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for way in ("pageable", "pinned", "prepared", "non-blocking"):
            r = measure(args, "tiny" if args.tiny else size, way)
            gb = r["bytes"] / 1e9

            def prepared(seconds: float | None) -> str:
                return "-" if seconds is None else f"{seconds:.3f}"

            def rate(seconds: float, gb: float = gb) -> str:
                return f"{gb / seconds:.1f}" if args.device == "cuda" else "-"  # nothing moves off GPUs

            print(
                f"| {r['size']} | {way} | {r['gib']:.2f} | {prepared(r['prepare'])} | {r['first']:.3f} | "
                f"{r['out']:.3f} | {r['first'] / max(r['out'], 1e-9):.1f} | {rate(r['out'])} | {r['in']:.3f} | "
                f"{rate(r['in'])} | {r['pinned']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
