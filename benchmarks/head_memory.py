"""Peak memory and time of the head on the scored positions: the logits path (``F.linear`` to ``(K, V)``
logits, then ``selected_logprobs_and_entropy``, what the trainer ran before the fused head) against the
fused head (``linear_logprobs_and_entropy``: no ``(K, V)`` logits kept), for ``K`` scored tokens, a
``(V, H)`` head without bias.

    python benchmarks/head_memory.py                                  # 0.5B head, K = 1024, CPU
    python benchmarks/head_memory.py --tokens 16384 --device cuda --dtypes bfloat16

Each case runs in a fresh process. The number is the peak memory above the inputs (hidden states,
weight): on CPU the peak resident set size, on CUDA ``torch.cuda.max_memory_allocated``
(``benchmarks/logprob_memory.py``). ``forward`` scores without autograd (reference and old-logprob
passes); ``fwd+bwd`` computes the log-probs and the entropy, detached (a metric, as with
``algorithm.entropy_coef`` 0), and backpropagates the log-probs' loss into the hidden states and the
weight, whose gradient ``(V, H)`` both paths make. On CUDA each case runs once to warm up first.

Measured 2026-12-06 on the CPU (AMD EPYC, 2 cores shared with other jobs: load average 5 to 8, so the
seconds are rough), torch 2.13, Qwen2.5-0.5B's head (H 896, V 151936), temperature 0.7; GiB above the
inputs, seconds::

    K     dtype     pass      logits GiB   logits s   fused GiB    fused s
    1024  float32   forward         0.72       9.2        0.20       12.7
    1024  float32   fwd+bwd         1.30      21.0        0.68       33.2
    1024  bfloat16  forward         0.43       5.3        0.17        5.5
    1024  bfloat16  fwd+bwd         0.76      12.1        0.46       13.1
    4096  bfloat16  forward         1.30      25.9        0.20       20.7
    4096  bfloat16  fwd+bwd         2.49      45.2        0.54       58.6

Both ``fwd+bwd`` columns include the weight's ``(V, H)`` gradient (0.25 GiB in bf16). The logits path
keeps ``K x V`` logits for backward and writes their gradient, ``2 K V`` bytes each in bf16 (1.16 GiB at
``K`` 4096, 9.3 at 16384: 64 rows of 256 response tokens); the fused path keeps ``K`` floats a row and
works in blocks of about ``2**24`` elements (``2**26`` on a GPU). Its backward makes the logits again:
one more ``K x V x H`` matmul, 4/3 of the logits path's head FLOPs (1.30x the seconds at ``K`` 4096).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.generation import _cpu_name  # noqa: E402
from benchmarks.logprob_memory import case_table, logprobs_module, measured  # noqa: E402


def one_case(
    impl: str, mode: str, tokens: int, hidden: int, vocab: int, dtype: str, device: str, temperature: float
) -> dict[str, float]:
    """Run one case in this process: peak bytes above the inputs and seconds."""
    lp = logprobs_module()
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h = torch.randn(tokens, hidden, dtype=dt, device=device)
    w = torch.randn(vocab, hidden, dtype=dt, device=device).mul_(hidden**-0.5)  # no fp32 copy: RSS
    targets = torch.randint(0, vocab, (tokens,), device=device)
    weights = torch.randn(tokens, device=device)

    def stats(x: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if impl == "fused":
            return lp.linear_logprobs_and_entropy(x, head, None, targets, temperature)
        return lp.selected_logprobs_and_entropy(torch.nn.functional.linear(x, head), targets, temperature)

    def run() -> None:
        if mode == "forward":
            with torch.no_grad():
                stats(h, w)
        else:
            x, head = h.detach().requires_grad_(), w.detach().requires_grad_()
            logp, ent = stats(x, head)
            float(ent.detach().mean())  # the metric
            (logp * weights).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    return measured(run, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tokens", type=int, default=1024, help="scored tokens K (a micro-batch's response tokens)"
    )
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--impls", nargs="+", default=["logits", "fused"])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, JSON out
    args = ap.parse_args()
    shape = (args.tokens, args.hidden, args.vocab)
    if args.case:
        impl, mode, dtype = args.case.split(",")
        print(json.dumps(one_case(impl, mode, *shape, dtype, args.device, args.temperature)))
        return
    hw = torch.cuda.get_device_name() if args.device == "cuda" else _cpu_name()
    print(f"head (V {args.vocab}, H {args.hidden}) at K {args.tokens} scored tokens on {args.device} ({hw}, "
          f"torch {torch.__version__}); temperature {args.temperature}")  # fmt: skip
    cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--hidden", str(args.hidden)]
    cmd += ["--vocab", str(args.vocab), "--device", args.device, "--temperature", str(args.temperature)]
    case_table(cmd, args.impls, args.dtypes)


if __name__ == "__main__":
    main()
