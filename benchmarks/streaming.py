"""Streaming rewards with over-sampling, and partial rollouts, on the tiny test model, as a table.

    python benchmarks/streaming.py              # every row (about 6 minutes on 2 loaded cores)
    python benchmarks/streaming.py --steps 3    # quicker

The policy is the random tiny model the tests use (hidden 64, 2 layers), so responses run to an
uneven length (it rarely stops early): what matters here is what over-sampling drops and keeps, and
how partial rollouts change staleness, not learning. Every row trains ``--steps`` GRPO steps of 32
samples (8 prompts x 4), responses up to 64 tokens.

Over-sampling rows (``runtime.backend: local``, so the step's phases take turns): per step, the
prompts drawn, groups dropped, mean response length of kept vs dropped samples (dropped ones that
were interrupted count the tokens they had: a lower bound), and ``timing/generate``.
Partial-rollout rows (Ray, ``async_steps: 1``, hf engine on a CPU slot of its own): the staleness
of the trained tokens and the share of samples with tokens of two policy versions.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from pathlib import Path

import yaml

from reroll.cli import main
from reroll.data.arithmetic import ARITHMETIC_ALPHABET, write_arithmetic_dataset
from reroll.engines import engine_available
from reroll.models.tiny import build_tiny_model
from reroll.runtime.metrics import read_metrics

POOL = ["placement.devices=2", "placement.cpus_per_device=0.5", "roles.actor_infer.devices=[1]"]


def _config(root: Path, model: Path, data: dict[str, Path], steps: int) -> Path:
    cfg = {
        "pipeline": "rlvr",
        "name": "t",
        "output_dir": str(root / "runs" / "{name}"),
        "total_steps": steps,
        "model": {"path": str(model)},
        "data": {
            "train_files": [str(data["train"])],
            "eval_files": [str(data["test"])],
            "prompt_template": "{question}=",
        },
        "rollout": {"batch_size": 32, "group_size": 4, "max_new_tokens": 64},
        "optim": {"lr": 1e-3, "micro_batch_size": 32},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "actor_infer", "reference", "reward")},
        "logging": {"tensorboard": False},
    }
    path = root / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _mean(rows: list[dict[str, float]], key: str) -> float:
    values = [m[key] for m in rows if key in m]
    return statistics.fmean(values) if values else float("nan")


def main_(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", choices=["oversample", "partial"], help="one of the two tables")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="reroll-streaming-"))
    model = build_tiny_model(
        root / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=2, num_heads=2
    )
    data = write_arithmetic_dataset(root / "data", n_train=400, n_test=64, max_operand=30, ops="+", seed=0)
    cfg = _config(root, Path(model), data, args.steps)
    engines = ["hf", "vllm"] if engine_available("vllm") else ["hf"]
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| engine | rollout.oversample | dropped groups | kept len | dropped len | dropped unfinished | generate s |"
    )
    print("|---|---|---|---|---|---|---|")
    for engine in engines if args.only != "partial" else []:
        for over in (None, 1.0, 1.25, 2.0):
            name = f"{engine}-{over}"
            extra = [] if over is None else [f"rollout.oversample={over}"]
            assert (
                main(
                    [
                        "train",
                        str(cfg),
                        f"name={name}",
                        f"rollout.engine={engine}",
                        "runtime.backend=local",
                        *extra,
                    ]
                )
                == 0
            )
            rows = [m for m in read_metrics(root / "runs" / name) if m["step"] > 1]  # step 1 warms up
            print(
                f"| {engine} | {over} | {_mean(rows, 'rollout/oversample_dropped_groups'):.2f} | "
                f"{_mean(rows, 'rollout/response_length'):.1f} | {_mean(rows, 'rollout/oversample_dropped_length'):.1f} | "
                f"{_mean(rows, 'rollout/oversample_dropped_unfinished'):.2f} | {_mean(rows, 'timing/generate'):.2f} |"
            )
    print()
    print(
        "| async_steps 1, hf | staleness/mean | staleness/mixed_samples | staleness/off_policy_tokens | step s | generate s |"
    )
    print("|---|---|---|---|---|---|")
    for partial in (False, True) if args.only != "oversample" else ():
        name = f"async-{partial}"
        run = [
            "train",
            str(cfg),
            f"name={name}",
            "rollout.async_steps=1",
            "rollout.generate_batch_size=4",
            *POOL,
        ]
        assert main([*run, f"rollout.partial_rollouts={str(partial).lower()}"]) == 0
        rows = [m for m in read_metrics(root / "runs" / name) if m["step"] > 1]
        print(
            f"| partial_rollouts {str(partial).lower()} | {_mean(rows, 'staleness/mean'):.3f} | "
            f"{_mean(rows, 'staleness/mixed_samples'):.3f} | {_mean(rows, 'staleness/off_policy_tokens'):.3f} | "
            f"{_mean(rows, 'timing/step'):.2f} | {_mean(rows, 'timing/generate'):.2f} |"
        )


if __name__ == "__main__":
    main_()
