"""Peak memory and time of per-token log-probs + entropy: the plain full-vocabulary fp32 computation
against ``reroll.algorithms.logprobs`` (chunked, recomputed in backward).

    python benchmarks/logprob_memory.py                               # (8, 512, 32000), CPU
    python benchmarks/logprob_memory.py --shape 64 384 151936 --device cuda --dtypes bfloat16

Each case runs in a fresh process. The number is the peak memory above what the inputs (the logits
and ids) already hold: on CPU the process's peak resident set size (``ru_maxrss``; tracemalloc does not
see torch's allocations, which bypass Python's allocator), on CUDA ``torch.cuda.max_memory_allocated``.
``forward`` scores without autograd (the reference and old-logprob passes); ``fwd+bwd`` backpropagates
a loss of both (the actor's step) and includes the gradient of the logits, which both keep. On CUDA
each case runs once to warm up first. ``reroll/algorithms/logprobs.py`` is loaded as a file, so the
script needs torch alone (as on a GPU machine without reroll's other dependencies).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plain(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``token_logprobs`` and ``token_entropy`` were before chunking, called one after the other."""
    scaled = logits[:, :-1].float() / temperature
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    scaled = logits[:, :-1].float() / temperature
    full = torch.log_softmax(scaled, dim=-1)
    ent = -(full.exp() * full).sum(-1)
    pad = torch.nn.functional.pad
    return pad(logp, (1, 0), value=0.0), pad(ent, (1, 0), value=0.0)


def logprobs_module():
    """``reroll/algorithms/logprobs.py`` loaded as a file: torch alone needed."""
    spec = importlib.util.spec_from_file_location("logprobs", ROOT / "reroll" / "algorithms" / "logprobs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chunked(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return logprobs_module().token_logprobs_and_entropy(logits, ids, temperature, chunk_tokens=chunk_tokens)


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def one_case(
    impl: str,
    mode: str,
    shape: list[int],
    dtype: str,
    device: str,
    chunk_tokens: int | None,
    temperature: float,
) -> dict[str, float]:
    """Run one case in this process; returns peak bytes above the inputs and seconds."""
    torch.manual_seed(0)
    b, t, v = shape
    logits = torch.randn(b, t, v, dtype=getattr(torch, dtype), device=device)
    ids = torch.randint(0, v, (b, t), device=device)
    weights = torch.randn(b, t, device=device)

    def run() -> None:
        fn = plain if impl == "plain" else lambda *a: chunked(*a, chunk_tokens=chunk_tokens)
        if mode == "forward":
            with torch.no_grad():
                fn(logits, ids, temperature)
        else:
            x = logits.detach().requires_grad_()
            logp, ent = fn(x, ids, temperature)
            ((logp - 0.01 * ent) * weights).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    return measured(run, device)


def measured(run, device: str) -> dict[str, float]:
    """``run()``'s rise in peak memory (bytes) and its seconds, on a GPU after one warm-up run."""
    if device == "cuda":
        run()  # warm-up
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = peak_bytes(device)
    start = time.perf_counter()
    run()
    return {"peak": peak_bytes(device) - base, "seconds": time.perf_counter() - start}


def case_table(cmd: list[str], impls: list[str], dtypes: list[str]) -> None:
    """Print a row per dtype and pass, each ``impl``'s peak GiB and seconds, every case in a process of
    its own (``cmd`` with ``--case impl,pass,dtype``: its last line the case's JSON; 'OOM' or 'failed'
    where it did not finish)."""
    print(f"{'dtype':<9} {'pass':<8}" + "".join(f" {i + ' GiB':>12} {i + ' s':>10}" for i in impls))
    for dtype in dtypes:
        for mode in ("forward", "fwd+bwd"):
            line = f"{dtype:<9} {mode:<8}"
            for impl in impls:
                out = subprocess.run(
                    [*cmd, "--case", f"{impl},{mode},{dtype}"], capture_output=True, text=True
                )
                if out.returncode != 0:
                    why = "OOM" if "OutOfMemory" in out.stderr else "failed"
                    line += f" {why:>12} {'':>10}"
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                line += f" {r['peak'] / 2**30:>12.2f} {r['seconds']:>10.3f}"
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[8, 512, 32000], metavar=("B", "T", "V"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--chunk-tokens", type=int, help="rows per chunk (default: the module's)")
    ap.add_argument("--impls", nargs="+", default=["plain", "chunked"])
    ap.add_argument("--temperature", type=float, default=0.7, help="1.0 takes the upcast-free kernels")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, JSON out
    args = ap.parse_args()
    if args.case:
        impl, mode, dtype = args.case.split(",")
        print(
            json.dumps(
                one_case(impl, mode, args.shape, dtype, args.device, args.chunk_tokens, args.temperature)
            )
        )
        return
    hw = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or 'cpu'}"
    b, t, v = args.shape
    chunk = args.chunk_tokens or "default"
    print(f"logits ({b}, {t}, {v}) on {args.device} ({hw}, torch {torch.__version__}); temperature {args.temperature}; "
          f"chunk_tokens {chunk}")  # fmt: skip
    cmd = [sys.executable, __file__, "--shape", *map(str, args.shape), "--device", args.device]
    cmd += ["--temperature", str(args.temperature)]
    if args.chunk_tokens:
        cmd += ["--chunk-tokens", str(args.chunk_tokens)]
    case_table(cmd, args.impls, args.dtypes)


if __name__ == "__main__":
    main()
