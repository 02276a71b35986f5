"""GRPO steps of a vision-language policy on one GPU: images through vLLM, the trainers and weight sync.

    python benchmarks/vision_step.py                      # Qwen2.5-VL-3B shape, bf16, on the GPU
    python benchmarks/vision_step.py --tiny --device cpu  # a smoke run of the script (tiny model, hf engine)

The model is Qwen2.5-VL's architecture at the 3B checkpoint's shape (text: 2048 wide, 36 layers, 16
heads, 2 KV heads, MLP 11008, vocabulary 151,936; vision tower: 32 blocks of 1280, 14-pixel patches,
2x2 merge), random init, built locally with ``reroll.models.tiny_vision`` (nothing downloaded). The task
is the shapes-counting rows of ``reroll.data.shapes`` drawn at ``--image-size`` pixels a side (448: 256
image tokens a prompt), an exact-match reward. The run is the product path: RLVR on Ray, actor_train,
actor_infer (vLLM, images as multi-modal data) and reference colocated on the one GPU, the vision tower
trained (``model.train_vision``) so that its weights are synced too.

It prints each step's phases and the step's seconds, the engine's new tokens per second (of the
generate phase) and the GPU's name; ``--json`` writes every step's metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import PHASES, device_name, mean_after, print_row, read_steps  # noqa: E402

# Qwen2.5-VL-3B-Instruct's config.json, the parts that set the cost of a step
QWEN25_VL_3B = dict(
    hidden_size=2048,
    num_layers=36,
    num_heads=16,
    num_kv_heads=2,
    intermediate_size=11008,
    vocab_size=151936,
    vision_hidden_size=1280,
    vision_depth=32,
    vision_intermediate_size=3420,
    vision_num_heads=16,
    patch_size=14,
)
TINY_VL = dict(hidden_size=64, num_layers=2, num_heads=2)


def build(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The model and the rows file (the shapes task at ``--image-size`` pixels)."""
    from reroll.data.shapes import SHAPES_ALPHABET, make_shapes_rows
    from reroll.models.tiny_vision import build_tiny_vl_model

    shape = TINY_VL if args.tiny else QWEN25_VL_3B
    pixels = args.image_size * args.image_size
    model = build_tiny_vl_model(
        root / "model",
        alphabet=SHAPES_ALPHABET,
        max_pixels=pixels,
        max_position_embeddings=4096,
        dtype=args.dtype,
        for_cpu_engine=args.tiny,
        **shape,
    )
    rows = make_shapes_rows(args.prompts * (args.steps + 2), size=args.image_size, seed=0)
    path = root / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, path


def run_steps(root: Path, model: Path, rows: Path, args: argparse.Namespace) -> list[dict]:
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.pipelines.rlvr import RLVR
    from reroll.pipelines.run import run

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    gpu = args.device == "cuda"
    name = "vision-step"
    cfg = {
        "pipeline": "rlvr",
        "name": name,
        "output_dir": str(root / "{name}"),
        "total_steps": args.steps + 1,  # the last step also evaluates: left out below
        "model": {
            "path": str(model),
            "dtype": args.dtype,
            "train_vision": True,
            "gradient_checkpointing": not args.tiny,
            "batched_vision_attention": args.vision_attention == "batched",
        },
        "data": {
            "train_files": [str(rows)],
            "prompt_template": "{question}",
            "chat_template": True,
            "eval_limit": 1,
        },
        "rollout": {
            "engine": args.engine,
            "batch_size": args.prompts * args.group,
            "group_size": args.group,
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "images": {"max_per_prompt": 1, "max_pixels": args.image_size * args.image_size},
            "vllm": {"gpu_memory_utilization": args.vllm_memory},
        },
        "reward": {"fn": "exact_match", "isolation": "thread"},
        "algorithm": {"preset": "grpo", "kl_coef": 0.04},
        "optim": {"lr": 1e-6, "micro_batch_size": args.micro_batch},
        "eval": {"every": 0},
        # no save at the end: 94 s of the 7B LoRA row's call on an H100 (2026-12-07)
        "checkpoint": {"every": 0, "keep_last": 1, "at_end": False},
        "logging": {"tensorboard": False, "sample_every": 0},
        "placement": {"devices": 1, "device_type": "cuda" if gpu else "cpu", "offload": "auto"},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run(RLVR, load_config(path, RunConfig))
    return read_steps(root / name, args.prompts * args.group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--engine", default=None, help="rollout engine (default: vllm on cuda, hf on cpu)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny model instead of Qwen2.5-VL-3B's shape")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--image-size", type=int, default=448, help="pixels a side (448: 256 image tokens)")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--vllm-memory", type=float, default=0.3)
    ap.add_argument(
        "--vision-attention",
        default="batched",
        choices=["batched", "loop"],
        help="the vision tower's attention: batched by length, or transformers' per-window sdpa loop "
        "(model.batched_vision_attention)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.engine = args.engine or ("vllm" if args.device == "cuda" else "hf")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.tiny:
        args.image_size = min(args.image_size, 32)

    root = Path(tempfile.mkdtemp(prefix="vision-bench-"))
    model, rows = build(root, args)
    steps = run_steps(root, model, rows, args)
    label = "tiny" if args.tiny else "Qwen2.5-VL-3B-shaped"
    print_row(f"reroll ray {label}", steps, args.warmup)
    step = mean_after(steps, "step", args.warmup)
    median = mean_after(steps, "step", args.warmup, statistics.median)
    gen = mean_after(steps, "generate", args.warmup)
    toks = mean_after(steps, "new_tokens", args.warmup)
    print(
        f"\nGRPO step, {label} random init, {args.dtype}, {args.prompts} prompts x {args.group} samples, "
        f"one {args.image_size}x{args.image_size} image + a question each, up to {args.new_tokens} new "
        f"tokens, {args.engine} engine, vision attention {args.vision_attention}, on "
        f"{device_name(args.device)}; mean of steps "
        f"{args.warmup + 1}..{len(steps)}"
    )
    print(f"{'phase':<14}{'seconds':>10}")
    for p in (*PHASES, "step"):
        print(f"{p:<14}{mean_after(steps, p, args.warmup):>10.2f}")
    print(f"\ns/step {step:.2f} (median {median:.2f}); engine {toks / max(gen, 1e-9):.0f} new tokens/s")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "steps": steps}))


if __name__ == "__main__":
    main()
