"""Where a GRPO step's trainer seconds go: the reference (forward-only) and training passes over one batch.

    python benchmarks/train_passes.py                    # Qwen2.5-0.5B shape, bf16, GPU
    python benchmarks/train_passes.py --tiny --device cpu  # a smoke run

One batch as `benchmarks/grpo_step.py` makes it (256 rows of 128 prompt + 256 response tokens, a quarter of
the rows padded at the end), random token ids, a Qwen2.5-0.5B-shaped model with random init (nothing
downloaded). Timed, per batch: the reference pass (forward + the response tokens' log-probs, no grad) and
the training pass (forward + their log-probs and entropy + backward), as the trainer runs them (the head
at the positions before the response tokens alone, computing their log-probs and entropy itself:
``fused_head_at``), at several rows per pass (``--micro-batches``, what
``optim.logprob_micro_batch_size`` and ``optim.micro_batch_size`` set), first with the model's own RMSNorm
layers and then fused (``model.fused_norm``, the default; every later row has it); then at 64 rows with the
head's ``(K, V)`` logits at those positions (``head_at``, the trainer before the fused head), with the head at
every position (the trainer before 2026-12-05) and with several log-prob chunk sizes (tokens upcast to
fp32 at a time), at 2 and 4 times 64 rows a pass (what the fused head's memory may allow; the peak
column says), then both passes with ``model.compile`` (the model
through ``torch.compile``, dynamic shapes). Those batches have one shape; an RL step's micro-batches have
new lengths every step, so on a GPU the last rows run ``--new-shapes`` batches whose rows have random
response lengths (sorted longest first and cut into micro-batches trimmed to their longest row, as the
trainer does), each batch's shapes new, with cuDNN's attention allowed (what torch picks first on Hopper:
a plan built per new shape) and not (``model.cudnn_attention: false``, reroll's default).
The optimizer step is left out (the same in every row). Mean of ``--repeat`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import QWEN25_05B, TINY, device_name, qwen2_config  # noqa: E402
from reroll.algorithms.logprobs import chunk_rows, token_logprobs_and_entropy  # noqa: E402
from reroll.models.loading import fuse_rms_norms  # noqa: E402
from reroll.roles.scored_tokens import scored_token_stats  # noqa: E402
from reroll.strategies.training import compile_model  # noqa: E402


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    shape = dict(TINY if args.tiny else QWEN25_05B)
    if args.layers:
        shape["num_layers"] = args.layers
    # no KV cache, as the trainers run it: a cache's layer index made compile_model's graphs one per layer,
    # past dynamo's limit of 8 (H100, 2026-12-07: the compiled passes slower than eager)
    cfg = qwen2_config(shape, args.vocab, max_position_embeddings=args.seq + 8, use_cache=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        return Qwen2ForCausalLM(cfg).to(getattr(torch, args.dtype))


def scored_stats(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    scored: torch.Tensor,
    chunk: int | None,
    *,
    entropy: bool,
    full_head: bool,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (and entropy) of the ``scored`` columns, as the trainer computes them: the head at the
    positions before those columns alone, computing their log-probs itself (``fused_head_at``, the torch
    and FSDP2 strategies' default) or with ``fused`` off their logits (``head_at``); or with ``full_head``
    the logits of every position read at those columns (the trainer before the head was restricted)."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def forward() -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits

    if full_head:
        return token_logprobs_and_entropy(forward(), ids, 1.0, chunk_tokens=chunk, mask=scored)
    rows, cols = torch.nn.functional.pad(scored[:, 1:].bool(), (0, 1), value=False).nonzero(as_tuple=True)
    picked = rows * ids.shape[1] + cols
    return scored_token_stats(
        model, forward, picked, rows, cols, ids, 1.0, entropy=entropy, chunk_tokens=chunk, fused=fused
    )


def reference_pass(
    model: torch.nn.Module,
    ids,
    mask,
    scored,
    chunk: int | None = None,
    *,
    full_head: bool = False,
    fused=True,
) -> None:
    """One forward-only pass over a micro-batch: the log-probs of the ``scored`` columns."""
    with torch.no_grad():
        scored_stats(model, ids, mask, scored, chunk, entropy=False, full_head=full_head, fused=fused)


def train_pass(
    model: torch.nn.Module,
    ids,
    mask,
    scored,
    chunk: int | None = None,
    *,
    full_head: bool = False,
    fused=True,
) -> None:
    """One training pass over a micro-batch: log-probs and entropy of the ``scored`` columns, backward."""
    logp, entropy = scored_stats(
        model, ids, mask, scored, chunk, entropy=True, full_head=full_head, fused=fused
    )
    (logp.mean() * 1e-3).backward()
    float(entropy.detach().mean())  # the metric's sync, as the trainer has it


def new_shapes(model: torch.nn.Module, args: argparse.Namespace, mb: int) -> tuple[float, float]:
    """Seconds per batch of the reference and training passes over ``args.new_shapes`` batches whose
    rows have ``seq / 3`` prompt tokens (128 of 384) and from 16 to the rest in response tokens, drawn
    afresh per batch: rows sorted longest first, micro-batches of ``mb`` rows trimmed to their longest
    row. Seeded: every call meets the same shapes."""
    gen = torch.Generator().manual_seed(1)
    dev, prompt = args.device, args.seq // 3
    seconds = {"reference": 0.0, "train": 0.0}
    for _ in range(args.new_shapes):
        lengths = (prompt + torch.randint(16, args.seq - prompt + 1, (args.rows,), generator=gen)).sort(
            descending=True
        )
        ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=gen).to(dev)
        mask = (torch.arange(args.seq)[None] < lengths.values[:, None]).long().to(dev)
        parts = [
            (ids[a : a + mb, : int(n)], mask[a : a + mb, : int(n)])
            for a, n in zip(range(0, args.rows, mb), lengths.values[::mb])
        ]
        for name, one_pass in (("reference", reference_pass), ("train", train_pass)):
            _sync(dev)
            start = time.perf_counter()
            for x, m in parts:
                scored = m.clone()
                scored[:, :prompt] = 0
                one_pass(model, x, m, scored)
            _sync(dev)
            seconds[name] += time.perf_counter() - start
    return seconds["reference"] / args.new_shapes, seconds["train"] / args.new_shapes


def profile(run: Callable[[], None], device: str, top: int) -> None:
    """The ``top`` kernels (operators on CPU) of one training pass over the batch, by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run()  # warm-up
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        run()
        _sync(device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60), flush=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seq", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--chunks", type=int, nargs="+", default=[110, 440, 1760], help="log-prob chunk tokens")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--profile", type=int, default=0, help="print this many top kernels of one training pass (0: none)"
    )
    ap.add_argument("--new-shapes", type=int, help="batches of new lengths (default: 4 on a GPU, 0 on CPU)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's; fewer for a CPU run)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (and --vocab 1000) for a smoke run")
    args = ap.parse_args()
    if args.tiny:
        args.vocab, args.rows, args.seq = 1000, 32, 48
        args.micro_batches, args.chunks = [8, 16], [16, 64]

    if args.new_shapes is None:
        args.new_shapes = 4 if args.device == "cuda" else 0
    model = build_model(args)
    dev, b, t = args.device, args.rows, args.seq
    ids = torch.randint(0, args.vocab, (b, t), device=dev)
    mask = torch.ones(b, t, dtype=torch.long, device=dev)
    mask[::4, -20:] = 0  # right padding on a quarter of the rows
    scored = mask.clone()
    scored[:, : t // 3] = 0  # the response columns: 256 of 384 (the prompts' 128 are not scored)

    def timed(fn: Callable[[], None]) -> float:
        fn()
        _sync(dev)
        start = time.perf_counter()
        for _ in range(args.repeat):
            fn()
        _sync(dev)
        return (time.perf_counter() - start) / args.repeat

    def passes(
        one_pass: Callable[..., None], mb: int, chunk: int | None, full: bool, fused: bool
    ) -> Callable[[], None]:
        def run() -> None:
            for a in range(0, b, mb):
                s = slice(a, a + mb)
                one_pass(model, ids[s], mask[s], scored[s], chunk, full_head=full, fused=fused)

        return run

    def reference(
        mb: int, chunk: int | None = None, full: bool = False, fused: bool = True
    ) -> Callable[[], None]:
        return passes(reference_pass, mb, chunk, full, fused)

    def train(
        mb: int, chunk: int | None = None, full: bool = False, fused: bool = True
    ) -> Callable[[], None]:
        return passes(train_pass, mb, chunk, full, fused)

    print(
        f"Trainer passes over {b} rows x {t} tokens, {'tiny' if args.tiny else 'Qwen2.5-0.5B'}-shaped model, "
        f"vocabulary {args.vocab}, {args.dtype}, on {device_name(dev)}; seconds per batch, mean of "
        f"{args.repeat} (new shapes: of {args.new_shapes} batches)"
    )
    peak = f"{'peak GiB':>10}" if dev == "cuda" else ""
    print(f"{'setting':<44}{'reference':>12}{'train':>10}{peak}", flush=True)

    def add(name: str, ref: float, step: float) -> None:  # printed as measured: a run cut short keeps them
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:>10.1f}" if dev == "cuda" else ""
        print(f"{name:<44}{ref:>12.3f}{step:>10.3f}{peak}", flush=True)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()

    default_chunk = chunk_rows(torch.empty(1, args.vocab, device=dev))
    for mb in args.micro_batches:
        add(f"{mb} rows a pass, the model's own RMSNorm", timed(reference(mb)), timed(train(mb)))
    fuse_rms_norms(model)  # model.fused_norm, the trainers' default: every row below has it
    for mb in args.micro_batches:
        add(f"{mb} rows a pass, chunk {default_chunk} (default)", timed(reference(mb)), timed(train(mb)))
    mb = max(args.micro_batches)
    add(
        f"{mb} rows a pass, scored positions' logits",
        timed(reference(mb, fused=False)),
        timed(train(mb, fused=False)),
    )
    add(
        f"{mb} rows a pass, head at every position",
        timed(reference(mb, full=True)),
        timed(train(mb, full=True)),
    )
    if args.profile:
        profile(train(mb), dev, args.profile)
    for chunk in args.chunks:
        add(f"{mb} rows a pass, chunk {chunk}", timed(reference(mb, chunk)), timed(train(mb, chunk)))
    for grow in (2, 4):  # what the fused head's memory may allow
        big = mb * grow
        if b % big:
            continue
        try:
            add(f"{big} rows a pass, chunk {default_chunk}", timed(reference(big)), timed(train(big)))
        except torch.OutOfMemoryError:
            print(f"{big} rows a pass: out of memory", flush=True)
            torch.cuda.empty_cache()
            break
    if args.new_shapes:
        mb = min(args.micro_batches)
        for cudnn in (True, False):  # on CPU the flag changes nothing: both rows run the same kernels
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            ref_s, train_s = new_shapes(model, args, mb)
            add(f"{mb} rows a pass, new shapes, cuDNN {'on' if cudnn else 'off'}", ref_s, train_s)
        torch.backends.cuda.enable_cudnn_sdp(True)
    if not args.no_compile:  # what model.compile does: the model compiled in place, dynamic shapes
        compile_model(model)
        add(f"{mb} rows a pass, chunk {default_chunk}, model.compile", timed(reference(mb)), timed(train(mb)))


if __name__ == "__main__":
    main()
