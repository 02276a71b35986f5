"""Training throughput of a strategy: tokens/s and model FLOPs utilisation of forward+backward+step.

    python benchmarks/train_step.py                          # fsdp2 and torch, 0.5B shape, bf16, GPU
    python benchmarks/train_step.py --tiny --device cpu      # a smoke run
    python benchmarks/train_step.py --strategies torch --ckpt false 8 16 23 true   # per checkpointed count

Builds a random-init model of Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads, MLP
4864, vocab 151936; nothing downloaded), then times optimizer steps of ``--micro-batches`` micro-batches
of ``--batch`` x ``--seq`` tokens (next-token loss over every token) through each strategy after
``--warmup`` steps. Model FLOPs per token are 6 x (non-embedding parameters + the LM head) plus the
attention's 12 x layers x hidden x seq (the causal half counted, as PaLM's MFU does it); the peak
is measured in the same run as a bf16 8192^3 matmul (torch.matmul), so MFU is against what this
GPU actually reaches, not its datasheet. Beside the measured peak (``torch.cuda.max_memory_allocated``)
each row prints ``reroll plan``'s estimate of the trainer's peak for the same shape and micro-batch
(``reroll.config.role_memory.estimate``, the head at every position), the one ``model.gradient_checkpointing:
auto`` chooses its count from.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import ALPHABET, QWEN25_05B, TINY, device_name  # noqa: E402


def measured_peak_tflops(device: str) -> float:
    """bf16 (GPU) / fp32 (CPU) dense matmul rate, best of a few runs."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / 10)
    return 2 * n**3 / best / 1e12


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    cfg = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        params += model.get_input_embeddings().weight.numel()  # the head's matmul still runs
    return 6 * params + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq


def estimated_gib(cfg, model_dir: Path, seq: int) -> float:
    """``reroll plan``'s estimate of the trainer's peak for this config (its head at every position)."""
    from reroll.config.role_memory import estimate
    from reroll.models.shape import model_shape

    plans = estimate(cfg, model_shape(str(model_dir)), prompt_tokens=0)
    return next(p.gib for p in plans if p.role == "actor_train")


def time_strategy(name: str, model_dir: Path, args: argparse.Namespace, ckpt) -> dict[str, float]:
    from reroll.algorithms.logprobs import token_logprobs
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.strategies import make_strategy

    path = Path(tempfile.mkdtemp()) / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "pipeline": "sft",
                "model": {"path": str(model_dir), "dtype": args.dtype, "gradient_checkpointing": ckpt},
                "data": {"train_files": ["unused.jsonl"]},
                "sft": {},
                "strategy": {"name": name},
                "rollout": {"max_new_tokens": args.seq},  # the estimate's head at every position
                "optim": {"micro_batch_size": args.batch},
            }
        )
    )
    cfg = load_config(path, RunConfig)
    est = estimated_gib(cfg, model_dir, args.seq)
    s = make_strategy(
        cfg,
        model_path=str(model_dir),
        device=args.device,
        trainable=True,
        rank=0,
        world_size=1,
        head="causal_lm",
    )
    s.configure_optimizer(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0)
    vocab = min(s.model.config.vocab_size, 30000)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    tokens = args.batch * args.seq * args.micro_batches

    def step(s=s) -> None:
        for _ in range(args.micro_batches):
            logits = s.logits(ids, mask)
            loss = -token_logprobs(logits, ids.to(logits.device), 1.0).mean() / args.micro_batches
            s.backward(loss)
        s.step(1.0)

    for _ in range(args.warmup):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    secs = (time.perf_counter() - t) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    fpt = flops_per_token(s.model, args.seq)
    del s
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "tokens_per_s": tokens / secs,
        "tflops": fpt * tokens / secs / 1e12,
        "peak_gib": peak,
        "est_gib": est,
        "s": secs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--strategies", nargs="+", default=["fsdp2", "torch"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--ckpt",
        nargs="*",
        default=["false"],
        help="model.gradient_checkpointing settings, a row each: true (the flag alone), false, a count of "
        "first layers (e.g. --ckpt false 8 16 23 true)",
    )
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()

    from reroll.models.tiny import build_tiny_model

    model_dir = build_tiny_model(
        Path(tempfile.mkdtemp()) / "model",
        alphabet=ALPHABET,
        vocab_size=None if args.tiny else 151936,
        max_position_embeddings=args.seq,
        dtype=args.dtype,
        **(TINY if args.tiny else QWEN25_05B),
    )
    peak = measured_peak_tflops(args.device)
    settings = [yaml.safe_load(v) for v in args.ckpt] or [True]
    rows = [(name, c, time_strategy(name, model_dir, args, c)) for name in args.strategies for c in settings]
    shape = "tiny" if args.tiny else "Qwen2.5-0.5B-shaped"
    print(
        f"\ntraining step, {shape} random init, {args.dtype}, {args.micro_batches} x {args.batch} x "
        f"{args.seq} tokens per step, 1 rank, on {device_name(args.device)}; measured matmul peak "
        f"{peak:.0f} TFLOP/s"
    )
    print(
        f"{'strategy':<10}{'ckpt':>6}{'s/step':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}"
        f"{'plan GiB':>10}"
    )
    for name, c, r in rows:
        print(
            f"{name:<10}{str(c).lower():>6}{r['s']:>9.3f}{r['tokens_per_s']:>11.0f}{r['tflops']:>9.1f}"
            f"{r['tflops'] / peak:>7.1%}{r['peak_gib']:>10.1f}{r['est_gib']:>10.1f}"
        )


if __name__ == "__main__":
    main()
