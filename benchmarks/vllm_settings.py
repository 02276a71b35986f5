"""Which of vLLM's own settings move reroll's host-bound decode: one engine per setting, each in a process.

    python benchmarks/vllm_settings.py                                  # Qwen2.5-0.5B shape, bf16, GPU
    python benchmarks/vllm_settings.py --tiny --device cpu --settings shipped,no-prefix-cache   # smoke run

A small model at the GRPO step's batch (32 prompts x 8 samples x 256 new tokens) keeps the GPU mostly
idle while vLLM's scheduler runs on the host between decoding steps (``benchmarks/vllm_outputs.py
--profile``). This builds reroll's vLLM engine (as ``benchmarks/grpo_step.py`` does: CUDA graphs,
engine in the process, no log-probs) once per setting, each in a fresh process (vLLM reads some of
them at start only), and times ``--rounds`` calls after a warm-up:

- ``shipped``: the engine as reroll builds it;
- ``no-prefix-cache``: ``enable_prefix_caching=False`` (the scheduler hashes every full KV block);
- ``stats``: ``disable_log_stats=False``, vLLM's per-request stats each step, which reroll's in-process
  engine turned off on 2026-12-07 (it reads the scheduler's load itself; 13 % of a decode step's host
  time on this repository's 2-core CPU, tiny model, one process alternating the two);
- ``v1-runner`` / ``v2-runner``: ``VLLM_USE_V2_MODEL_RUNNER`` 0 / 1 (the GPU model runner).

Prints, per setting, whether vLLM ran async scheduling and its V2 model runner, the seconds per call
and new tokens/s. Random init, built locally (nothing downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import build_inputs, device_name  # noqa: E402
from benchmarks.vllm_outputs import ENGINE_ARGS, build_engine, engine_arguments  # noqa: E402

# setting -> (vllm.LLM keyword arguments over reroll's, environment)
SETTINGS: dict[str, tuple[dict, dict[str, str]]] = {
    "shipped": ({}, {}),
    "no-prefix-cache": ({"enable_prefix_caching": False}, {}),
    "stats": ({"disable_log_stats": False}, {}),
    "v1-runner": ({}, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "v2-runner": ({}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
}


def time_setting(args: argparse.Namespace, model: str, prompts: list[str], llm_kwargs: dict) -> dict:
    """In this process: reroll's engine with ``llm_kwargs`` over its own, timed."""
    import vllm

    shipped_llm = vllm.LLM

    class LLM(shipped_llm):  # the engine builds ``vllm.LLM(...)``: the setting goes over its arguments
        def __init__(self, **kwargs) -> None:
            super().__init__(**{**kwargs, **llm_kwargs})

    vllm.LLM = LLM
    from reroll.data.types import SamplingParams

    engine = build_engine(args, Path(model))
    config = engine.llm.llm_engine.vllm_config
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    engine.generate(prompts, params)  # warm-up
    seconds, tokens = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        groups = engine.generate(prompts, params)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(len(c.response_ids) for g in groups for c in g))
    return {
        "async": bool(config.scheduler_config.async_scheduling),
        "v2_runner": bool(getattr(config, "use_v2_model_runner", False)),
        "seconds": seconds,
        "tokens": tokens,
    }


def main() -> None:
    ap = engine_arguments(__doc__.splitlines()[0], rounds=4, vllm_memory=0.15)
    ap.add_argument("--settings", default="shipped,no-prefix-cache,stats,v1-runner,shipped")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: one setting, in a fresh process
    args = ap.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"--settings: unknown {unknown}; choose from {sorted(SETTINGS)}")

    if args.child:
        model, prompts_file = args.child.split("::")
        prompts = json.loads(Path(prompts_file).read_text())
        print("RESULT " + json.dumps(time_setting(args, model, prompts, SETTINGS[names[0]][0])), flush=True)
        return

    args.steps = 0  # build_inputs makes the prompts of steps + 1 batches
    root = Path(tempfile.mkdtemp(prefix="reroll-bench-"))
    model, prompts = build_inputs(root, args, "0.5b")
    (root / "prompts.json").write_text(json.dumps(prompts))
    print(
        f"vLLM settings on {device_name(args.device)}, {'tiny' if args.tiny else 'Qwen2.5-0.5B'} shape, "
        f"{args.dtype}; {args.prompts} prompts x {args.n} samples, {args.prompt_len} prompt + up to "
        f"{args.new_tokens} new tokens; {args.rounds} calls each after a warm-up, one process per setting\n"
        "| setting | async scheduling | V2 runner | s per call | new tokens/s | calls (s) |\n|---|---|---|---|---|---|",
        flush=True,
    )
    shared = []  # the child gets the same options
    for key in ENGINE_ARGS:
        value = getattr(args, key)
        if value is not False:
            shared.append(f"--{key.replace('_', '-')}" + ("" if value is True else f"={value}"))
    for name in names:
        child = f"--child={model}::{root / 'prompts.json'}"
        command = [sys.executable, __file__, *shared, f"--settings={name}", child]
        done = subprocess.run(
            command, env={**os.environ, **SETTINGS[name][1]}, capture_output=True, text=True, check=False
        )
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(
                f"| {name} | failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]} |||||",
                flush=True,
            )
            continue
        r = json.loads(line[len("RESULT ") :])
        mean = statistics.mean(r["seconds"])
        calls = ", ".join(f"{s:.2f}" for s in r["seconds"])
        print(
            f"| {name} | {r['async']} | {r['v2_runner']} | {mean:.2f} | "
            f"{statistics.mean(r['tokens']) / mean:,.0f} | {calls} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
