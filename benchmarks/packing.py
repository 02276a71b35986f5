"""Packed rows against padded micro-batches in the trainer's two passes, on an RL batch of mixed lengths.

    python benchmarks/packing.py                      # Qwen2.5-0.5B shape, bf16, GPU
    python benchmarks/packing.py --tiny --device cpu  # a smoke run

One batch of ``--rows`` rows: 128 prompt tokens and a response of 16 to 256 tokens drawn uniformly
(seeded), random token ids, a Qwen2.5-0.5B-shaped model with random init (nothing downloaded). The rows
are sorted longest first (``optim.group_by_length``) and cut into micro-batches of ``--micro-batch``
rows, then timed through the trainer's own code (``StrategyWorker.response_stats``: the head at the
response positions alone) in three ways:

- **padded**: each micro-batch trimmed to its longest row (``optim.packing: false``);
- **packed, sdpa mask**: each micro-batch's real tokens end to end in one row, on transformers' ``sdpa``
  attention, which builds a block-diagonal ``(L, L)`` mask and attends over all of it (``optim.packing``
  before ``packed_attention``);
- **packed, rows apart**: the same rows on ``packed_attention`` (``optim.packing`` now): each row attends
  alone, in one call of torch's variable-length flash-attention kernel on CUDA.

``--uniform`` makes every response 256 tokens (no padding to save: what packing costs where it cannot
help). Seconds per batch, mean of ``--repeat`` after one warm-up; the largest difference of the response
log-probs from the padded way's is printed as a check.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import device_name  # noqa: E402
from benchmarks.train_passes import build_model  # noqa: E402
from reroll.data.packing import length_order, micro_batches  # noqa: E402
from reroll.data.types import TrainBatch  # noqa: E402
from reroll.models.loading import fuse_rms_norms  # noqa: E402
from reroll.models.packed_attention import attend_rows_apart  # noqa: E402
from reroll.roles.strategy_worker import StrategyWorker  # noqa: E402
from reroll.strategies.training import forward_logits  # noqa: E402


def rl_batch(args: argparse.Namespace) -> TrainBatch:
    """``args.rows`` right-padded rows of 128 prompt tokens and 16-256 response tokens, longest first."""
    gen = torch.Generator().manual_seed(0)
    prompt, width = args.seq // 3, args.seq
    low = width - prompt if args.uniform else 16
    lengths = prompt + torch.randint(low, width - prompt + 1, (args.rows,), generator=gen)
    cols = torch.arange(width)[None]
    mask = cols < lengths[:, None]
    batch = TrainBatch(
        input_ids=torch.randint(0, args.vocab, (args.rows, width), generator=gen) * mask,
        attention_mask=mask,
        response_mask=mask & (cols >= prompt),
        group_ids=torch.arange(args.rows),
        advantages=torch.zeros(args.rows, width),
        num_tokens=float((mask & (cols >= prompt)).sum()),
        num_seqs=float(args.rows),
    )
    return batch.select(length_order(batch))


def worker(model: torch.nn.Module, device: str, packing: bool) -> SimpleNamespace:
    """What ``StrategyWorker.response_stats`` reads of a worker: whether it packs, the model."""
    strategy = SimpleNamespace(
        model=model,
        logits=lambda ids, mask, pos=None: forward_logits(model, torch.device(device), ids, mask, pos),
    )
    return SimpleNamespace(packing=packing, strategy=strategy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seq", type=int, default=384, help="prompt (a third) + the longest response")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--uniform", action="store_true", help="every response of the longest length")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (and --vocab 1000) for a smoke run")
    args = ap.parse_args()
    if args.tiny:
        args.vocab, args.rows, args.seq, args.micro_batch = 1000, 32, 48, 8
    dev = args.device
    model = build_model(args)
    model.config.use_cache = False  # as the strategies set it: with a cache transformers ignores packed rows
    fuse_rms_norms(model)  # the trainers' default
    batch = rl_batch(args)
    parts = micro_batches(batch, max_rows=args.micro_batch, max_tokens=None)  # on the host, as the trainer's
    real, padded_tokens = int(batch.attention_mask.sum()), sum(p.input_ids.numel() for p in parts)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    def run(w: SimpleNamespace, train: bool) -> list[torch.Tensor]:
        out = []
        for mb in parts:
            with torch.set_grad_enabled(train):
                logp, ent = StrategyWorker.response_stats(w, mb, 1.0, entropy=train)
            if train:
                (logp.sum() * 1e-6).backward()
                float(ent.detach().mean())
            out.append(logp.detach())
        model.zero_grad(set_to_none=True)
        return out

    def timed(w: SimpleNamespace, train: bool) -> float:
        run(w, train)
        sync()
        start = time.perf_counter()
        for _ in range(args.repeat):
            run(w, train)
        sync()
        return (time.perf_counter() - start) / args.repeat

    print(
        f"Trainer passes over {args.rows} rows ({real} real tokens, {padded_tokens} in padded micro-batches of "
        f"{args.micro_batch} rows, responses {'all' if args.uniform else '16 to'} {args.seq - args.seq // 3} tokens), "
        f"{'tiny' if args.tiny else 'Qwen2.5-0.5B'}-shaped model, {args.dtype}, on {device_name(dev)}; seconds "
        f"per batch, mean of {args.repeat}"
    )
    peak = f"{'peak GiB':>10}" if dev == "cuda" else ""
    print(f"{'way':<28}{'reference':>11}{'train':>9}{peak}{'max |dlogp|':>13}", flush=True)
    baseline = None
    for name, packing in (("padded", False), ("packed, sdpa mask", True), ("packed, rows apart", True)):
        if name == "packed, rows apart" and not attend_rows_apart(model):
            print(f"{name:<28} (the model's attention cannot be switched)")
            continue
        w = worker(model, dev, packing)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ref, train = timed(w, False), timed(w, True)
        logp = run(w, False)
        baseline = baseline or logp
        diff = max(float((a - b).abs().max()) for a, b in zip(logp, baseline, strict=True))
        mem = f"{torch.cuda.max_memory_allocated() / 2**30:>10.1f}" if dev == "cuda" else ""
        print(f"{name:<28}{ref:>11.3f}{train:>9.3f}{mem}{diff:>13.4f}", flush=True)


if __name__ == "__main__":
    main()
