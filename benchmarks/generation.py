"""Generation throughput of each engine, printed as a table, optionally against the decode roofline.

    python benchmarks/generation.py [--prompts 64] [--n 8] [--new-tokens 5 64] [--threads 2]
    python benchmarks/generation.py --device cuda --dtype bfloat16 --hidden 896 --layers 24 \
        --heads 14 --kv-heads 2 --intermediate 4864 --prompts 32 --n 8 --new-tokens 256 --roofline

Builds a tiny Qwen2 model (random init, offline; by default the quickstart's shape, or the shape given,
e.g. Qwen2.5-0.5B's above with a 21-token vocabulary) or uses ``--model DIR``, then for each installed
engine and each response length times ``generate`` over ``prompts x n`` samples (temperature 1)
after one warm-up call, and prints generated tokens per second. Engines that cannot run here are
listed with the reason.

``--roofline`` measures the device's memory bandwidth (a 1 GiB tensor copy, timed with CUDA events on
a GPU, wall clock on CPU; read + write bytes) and adds the decode roofline: every decode step reads
all weights once plus the KV cache of every sequence, so at batch ``B`` and mean context ``L``
    roofline tokens/s = bandwidth / (weight bytes + B * L * KV bytes per token) * B,
an upper bound for a memory-bound decode (prefill and sampling ignored; ``L`` is the mean prompt length
plus half the new tokens).
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


def _engine(name: str, model: str, dtype: str, device: str):
    """``name`` is an engine, or 'hf-static' (the hf engine with its static cache and compiled decode)."""
    from reroll.config.rollout import RolloutConfig
    from reroll.engines import make_engine

    engine = "hf" if name == "hf-static" else name
    rollout = RolloutConfig(engine=engine, generate_batch_size=512, hf_static_cache=name == "hf-static")
    return make_engine(model, rollout.model_copy(update={"engine": engine}), dtype=dtype, device=device)


def measure_bandwidth(device: str, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device tensor copy (read + write), best of ``repeats``."""
    import torch

    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (page faults on CPU)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * src.numel() * src.element_size() / best


def decode_roofline(
    bandwidth: float, weight_bytes: int, kv_bytes_per_token: int, batch: int, context: float
) -> float:
    """Tokens/s of a memory-bound decode: each step reads the weights and ``batch`` KV caches of
    ``context`` tokens, and yields ``batch`` tokens."""
    return bandwidth / (weight_bytes + batch * context * kv_bytes_per_token) * batch


def _model_bytes(model: str, dtype: str) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes per token) of a checkpoint directory, in ``dtype``."""
    import json

    import torch
    from safetensors import safe_open

    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    numel = 0
    for file in Path(model).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (not a dict)
                numel += _prod(f.get_slice(name).get_shape())
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return numel * itemsize, 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * itemsize


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return f"{_cpu_name()}, {os.cpu_count()} logical cores"


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
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    ap.add_argument(
        "--engines",
        nargs="+",
        default=["hf", "vllm", "sglang"],
        help="engines; 'hf-static': hf + static cache",
    )
    ap.add_argument("--vocab", type=int, default=None, help="pad the vocabulary (151936: Qwen2.5's)")
    ap.add_argument("--model", help="a local checkpoint directory (default: build a tiny Qwen2)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--roofline", action="store_true", help="measure bandwidth; add the decode roofline")
    args = ap.parse_args()

    import torch

    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.engines import engine_available
    from reroll.models.loading import load_tokenizer
    from reroll.models.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:  # default: the quickstart's model (examples/quickstart/arithmetic_grpo.yaml)
        model = str(
            build_tiny_model(
                Path(tempfile.mkdtemp(prefix="reroll-bench-")) / "model",
                alphabet=ARITHMETIC_ALPHABET,
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=args.heads,
                num_kv_heads=args.kv_heads,
                intermediate_size=args.intermediate,
                max_position_embeddings=max(128, 16 + max(args.new_tokens)),
                vocab_size=args.vocab,
            )
        )
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 10 + args.prompts), range(50, 50 + args.prompts))]
    rows, skipped = [], []
    for name in args.engines:
        if not engine_available(name.removesuffix("-static")):
            skipped.append(f"{name}: not installed")
            continue
        try:
            engine = _engine(name, model, args.dtype, args.device)
        except Exception as e:  # e.g. sglang without a GPU
            skipped.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        for new_tokens in args.new_tokens:
            tps, seconds = _measure(engine, prompts, args.n, new_tokens, args.repeats)
            rows.append((name, new_tokens, tps, seconds))
        del engine

    print(f"\nhardware: {_device_name(args.device)}; torch threads {args.threads}, torch {torch.__version__}")
    print(
        f"model: {args.model or f'tiny Qwen2 (hidden {args.hidden}, {args.layers} layers, {args.heads} heads)'}, "
        f"{args.dtype}; {args.prompts} prompts x {args.n} samples, temperature 1"
    )
    header, rule = "| engine | max new tokens | tokens/s | s per call |", "|---|---|---|---|"
    roofline = None
    if args.roofline:
        bandwidth = measure_bandwidth(args.device)
        weight_bytes, kv_bytes = _model_bytes(model, args.dtype)
        tok = load_tokenizer(model)
        prompt_len = sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts) / len(prompts)
        batch = args.prompts * args.n
        roofline = lambda new: decode_roofline(bandwidth, weight_bytes, kv_bytes, batch, prompt_len + new / 2)  # noqa: E731
        print(
            f"roofline: measured copy bandwidth {bandwidth / 1e9:,.1f} GB/s; weights {weight_bytes / 2**20:,.1f} "
            f"MiB, KV {kv_bytes:,} B/token, batch {batch}, mean prompt {prompt_len:.1f} tokens"
        )
        header, rule = header + " roofline tokens/s | % of roofline |", rule + "---|---|"
    print(f"\n{header}\n{rule}")
    for name, new_tokens, tps, seconds in rows:
        line = f"| {name} | {new_tokens} | {tps:,.0f} | {seconds:.2f} |"
        if roofline is not None:
            line += f" {roofline(new_tokens):,.0f} | {100 * tps / roofline(new_tokens):.1f} |"
        print(line)
    for line in skipped:
        print(f"not measured: {line}")


if __name__ == "__main__":
    main()
