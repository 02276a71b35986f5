"""Generation throughput of each engine on the quickstart model, printed as a table.

    python benchmarks/generation.py [--prompts 64] [--n 8] [--new-tokens 5 64] [--threads 2]

Builds the quickstart's tiny Qwen2 model (random init, offline) in a temporary directory, then for
each installed engine and each response length times ``generate`` over ``prompts x n`` samples
(temperature 1, the quickstart's sampling) after one warm-up call, and prints generated tokens per
second. Engines that cannot run here are listed with the reason. CPU only: the H200 numbers of the
issue (Qwen2.5-0.5B shape, bf16, batch 256, 256 new tokens, against the bandwidth roofline) are not
measured by this script.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _engine(name: str, model: str):
    from reroll.config.schema import RolloutConfig
    from reroll.engines import make_engine

    return make_engine(name, model, RolloutConfig(engine=name, generate_batch_size=512))


def _measure(engine, prompts: list[str], n: int, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(tokens/s, seconds per call), the best of ``repeats`` calls after a warm-up."""
    from reroll.data.types import SamplingParams

    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens, seed=0)
    engine.generate(prompts, params)
    best_tps, best_s = 0.0, float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        groups = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.response_ids) for g in groups for c in g)
        if tokens / seconds > best_tps:
            best_tps, best_s = tokens / seconds, seconds
    return best_tps, best_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[5, 64])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.engines import engine_available
    from reroll.models.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="reroll-bench-")
    # the quickstart's model (examples/quickstart/arithmetic_grpo.yaml, model.build_tiny)
    model = str(
        build_tiny_model(
            Path(tmp) / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=128, num_layers=2, num_heads=4
        )
    )
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 10 + args.prompts), range(50, 50 + args.prompts))]
    rows, skipped = [], []
    for name in ("hf", "vllm", "sglang"):
        if not engine_available(name):
            skipped.append(f"{name}: not installed")
            continue
        try:
            engine = _engine(name, model)
        except Exception as e:  # e.g. sglang without a GPU
            skipped.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        for new_tokens in args.new_tokens:
            tps, seconds = _measure(engine, prompts, args.n, new_tokens, args.repeats)
            rows.append((name, new_tokens, tps, seconds))
        del engine

    print(
        f"\nhardware: {_cpu_name()}, {os.cpu_count()} logical cores, torch threads {args.threads}, "
        f"torch {torch.__version__}"
    )
    print(
        f"model: quickstart tiny Qwen2 (hidden 128, 2 layers, 4 heads), fp32; "
        f"{args.prompts} prompts x {args.n} samples, temperature 1\n"
    )
    print("| engine | max new tokens | tokens/s | s per call |\n|---|---|---|---|")
    for name, new_tokens, tps, seconds in rows:
        print(f"| {name} | {new_tokens} | {tps:,.0f} | {seconds:.2f} |")
    for line in skipped:
        print(f"not measured: {line}")


if __name__ == "__main__":
    main()
