"""The memory a checkpoint costs each FSDP2 rank: the sharded save and load (``state/`` by torch's
distributed checkpoint, ``model/`` one unit at a time) against the previous save, which gathered the
whole model on rank 0.

    python benchmarks/checkpoint_memory.py                    # Qwen2.5-0.5B shape, fp32, 1 2 4 ranks
    python benchmarks/checkpoint_memory.py --shape tiny --ranks 2   # a smoke run

A Qwen2.5-shaped model with random init (nothing downloaded), CPU ranks over gloo, each in a process
of its own, after one AdamW step (so the optimizer holds its moments). Each way runs in fresh processes,
once to import what it imports lazily and then measured: the rise of the process's peak resident
memory (``VmHWM``, reset through ``/proc/self/clear_refs``) above its resident memory before the
call, with every allocation of 64 KiB or more mapped on its own and returned when freed
(``MALLOC_MMAP_THRESHOLD_``), so memory one call freed cannot hide the next one's peak:

- ``sharded save``: ``FSDP2Strategy.save`` as a run calls it;
- ``gathered save``: what it did before 2026-12-06: ``full_state_dict`` (every tensor all-gathered,
  rank 0 keeping a full CPU copy), ``save_pretrained`` on rank 0, each rank's optimizer shard saved;
- ``sharded load``: ``FSDP2Strategy.load`` of the sharded save, at the same world size.

Prints one row per way and world size: seconds, and the rise on rank 0 and the largest on another rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import QWEN25_05B, TINY, device_name, qwen2_config  # noqa: E402
from benchmarks.host_memory import peak_rise  # noqa: E402

SHAPES = {"0.5b": (QWEN25_05B, 151936), "tiny": (TINY, 64)}
WAYS = ["gathered save", "sharded save", "sharded load"]


def build_model(root: Path, shape: str) -> Path:
    from transformers import Qwen2ForCausalLM

    s, vocab = SHAPES[shape]
    cfg = qwen2_config(s, vocab)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(root / "model")
    return root / "model"


def _rise(call) -> tuple[float, float]:
    """``call()``'s seconds and the rise of this process's peak resident memory above its memory before, GiB."""
    _, seconds, rise = peak_rise(call)
    return seconds, rise / 2**30


def _rank(rank: int, world_size: int, port: int, model: Path, way: str, out: Path, results) -> None:
    torch.set_num_threads(1)
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.strategies.fsdp2 import FSDP2Strategy, _gather

    config = out.parent / "c.yaml"
    cfg = load_config(config, RunConfig, [f"roles.actor_train.world_size={world_size}"])
    s = FSDP2Strategy(str(model), cfg=cfg, rank=rank, world_size=world_size)
    s.init_distributed(f"127.0.0.1:{port}")
    s.configure_optimizer(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0)
    ids = torch.randint(0, 64, (1, 8))
    s.backward(s.logits(ids, torch.ones_like(ids)).float().mean())
    s.step(1.0)

    def gathered(directory: Path) -> None:
        full = _gather(s.model.state_dict(), keep=rank == 0)
        if rank == 0:
            s.hf_model.save_pretrained(directory / "model", state_dict=full)
        state = {"optimizer": s.optimizer.state_dict(), "scheduler": s.scheduler.state_dict()}
        torch.save(state, directory / f"optimizer_rank{rank}.pt")

    calls = {
        "gathered save": gathered,
        "sharded save": lambda directory: s.save(directory, with_optimizer=True),
        "sharded load": s.load,
    }
    (out / "first").mkdir(parents=True, exist_ok=True)
    (out / "second").mkdir(parents=True, exist_ok=True)
    if way == "sharded load":
        s.save(out / "first", with_optimizer=True)
        torch.distributed.barrier()
        out = out / "first"
    # the second call is measured: the first imported what the way imports lazily (save_pretrained's
    # integrations), which would count as its memory
    calls[way](out / "first" if way != "sharded load" else out)
    torch.distributed.barrier()
    if rank == 0 and way != "sharded load":  # a 0.5B checkpoint is 5-7 GiB on disk: one at a time
        shutil.rmtree(out / "first")
    torch.distributed.barrier()
    seconds, rise = _rise(lambda: calls[way](out / "second" if way != "sharded load" else out))
    results.put((rank, seconds, rise))
    torch.distributed.barrier()


def rank_rows(
    rank_fn: Callable[..., None], world_size: int, subject: Path, way: str, out: Path
) -> list[tuple]:
    """``rank_fn(rank, world_size, port, subject, way, out, results)`` in ``world_size`` spawned processes
    (a free port for their group), the tuple each put on ``results``, sorted by rank; ``out`` removed after."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        rank_fn, args=(world_size, port, subject, way, out, results), nprocs=world_size, start_method="spawn"
    )
    rows = sorted(results.get() for _ in range(world_size))
    shutil.rmtree(out)
    return rows


def measure(model: Path, world_size: int, way: str, root: Path) -> tuple[float, float, float]:
    """(seconds on rank 0, rise on rank 0, the largest rise on another rank), GiB."""
    rows = rank_rows(_rank, world_size, model, way, root / f"{way.replace(' ', '_')}_{world_size}")
    others = max((r[2] for r in rows[1:]), default=float("nan"))
    return rows[0][1], rows[0][2], others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # every allocation of 64 KiB or more its own mapping, returned when freed: a later phase cannot
    # reuse a freed one without it counting (glibc's threshold would otherwise grow to 32 MiB)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root, args.shape)
        (root / "c.yaml").write_text(
            f"pipeline: rlvr\nname: b\noutput_dir: {root}/runs\nmodel: {{path: {model}}}\n"
            f"strategy: {{name: fsdp2}}\ndata: {{train_files: [{root}/x.jsonl]}}\n"
        )
        size = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 2**30
        print(
            f"{args.shape} shape, fp32 weights {size:.2f} GiB (+ 2x that in Adam moments), {device_name('cpu')}"
        )
        print(f"{'way':<16}{'ranks':>6}{'seconds':>9}{'rank 0 GiB':>12}{'other ranks GiB':>17}")
        for world_size in args.ranks:
            for way in args.ways:
                seconds, rank0, others = measure(model, world_size, way, root)
                print(f"{way:<16}{world_size:>6}{seconds:>9.2f}{rank0:>12.2f}{others:>17.2f}", flush=True)


if __name__ == "__main__":
    main()
