"""Lockstep vs streamed agentic episodes (``agentic.streaming``): the episodes phase of one step, as a table.

    python benchmarks/agentic_streaming.py                 # env workers as Ray actors
    python benchmarks/agentic_streaming.py --backend local # env workers in this process

The engine is the hf engine on a tiny random model in this process (greedy, ``--max-new-tokens``),
the episodes are played by the runners the agentic pipeline calls (``run_episodes``,
``stream_episodes``) against ``--workers`` env workers. The environment, ``Turns``, takes any answer
and lasts 2 to 5 turns; its steps sleep: ``fast`` not at all, ``jitter`` 0-40 ms each, ``tail``
0-20 ms, and 0.5 s for every step of one episode in eight (a slow sandbox), ``spikes`` 0-20 ms, and
0.5 s for one step in twenty of any episode (a tool call that is sometimes slow). Each row is the median of
``--repeats`` runs: wall seconds, episodes/s, engine calls and prompts per call, turn latency
p50/p95 (a turn: waiting for and running the engine call, then the environment step). Episodes are
the same in every row (greedy): the script checks it.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from reroll.config.schema import RunConfig
from reroll.data.types import SamplingParams
from reroll.engines.hf import HFEngine
from reroll.envs.trajectory import TrajectoryBuilder
from reroll.models.tiny import GAME_ALPHABET, build_tiny_model
from reroll.roles.env import EnvGroup, Episode, run_episodes, stream_episodes
from reroll.runtime.actors import start_ray


class Turns:
    """Any answer; ``2 + seed % 4`` turns; reward 1 at the end for even seeds. Step delays by ``latency``."""

    def __init__(self, latency: str = "fast") -> None:
        self.latency = latency

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.seed, self.turn, self.rng = seed or 0, 0, random.Random(seed)
        return f"pile {self.seed % 23}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        if self.latency == "jitter":
            time.sleep(self.rng.uniform(0, 0.04))
        elif self.latency == "tail":
            time.sleep(0.5 if self.seed % 8 == 7 else self.rng.uniform(0, 0.02))
        elif self.latency == "spikes":
            time.sleep(0.5 if self.rng.random() < 0.05 else self.rng.uniform(0, 0.02))
        done = self.turn == 2 + self.seed % 4
        return (
            f"pile {(len(action) * 7 + self.seed) % 19}",
            float(done and self.seed % 2 == 0),
            done,
            False,
            {},
        )


def _envs(latency: str, args: argparse.Namespace) -> EnvGroup:
    cfg = RunConfig.model_validate(
        {
            "pipeline": "agentic",
            "model": {"path": "unused"},
            "rollout": {"batch_size": args.episodes, "group_size": 1},
            "agentic": {
                "env": "benchmarks.agentic_streaming:Turns",
                "env_config": {"latency": latency},
                "streaming": True,  # lets a worker run calls concurrently; lockstep plays on it unchanged
                "eval_episodes": 0,
            },
            "roles": {"env": {"world_size": args.workers}},
            "runtime": {"backend": args.backend},
        }
    )
    return EnvGroup(cfg)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _counted(engine: HFEngine, sizes: list[int], prompts: list[list[int]], p: SamplingParams) -> list:
    sizes.append(len(prompts))
    return engine.generate(prompts, p)


def _row(mode: str, engine: HFEngine, envs: EnvGroup, args: argparse.Namespace) -> tuple[dict, list[Episode]]:
    builder = TrajectoryBuilder(engine.tokenizer)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    starts = [(seed, seed) for seed in range(args.episodes)]
    runs = []
    for _ in range(args.repeats):
        sizes: list[int] = []
        generate = partial(_counted, engine, sizes)
        runner = stream_episodes if mode == "streaming" else run_episodes
        extra = {"wait_s": args.wait_s} if mode == "streaming" else {}
        start = time.perf_counter()
        episodes = runner(generate, envs, builder, starts, params, max_turns=8, max_tokens=1024, **extra)
        wall = time.perf_counter() - start
        turns = [s for e in episodes for s in e.turn_seconds]
        runs.append(
            {
                "wall": wall,
                "eps": len(episodes) / wall,
                "calls": len(sizes),
                "batch": sum(sizes) / len(sizes),
                "p50": _pct(turns, 0.5),
                "p95": _pct(turns, 0.95),
            }
        )
    best = sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]
    return best, episodes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["ray", "local"], default="ray")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wait-s", type=float, default=0.05, help="agentic.batch_wait_s of the streamed rows")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="the engine's threads (a run's roles.actor_infer.torch_threads); the default 1 keeps the engine "
        "equally fast in the caller's thread (lockstep) and the batcher's (streaming) on a loaded machine",
    )
    p.add_argument("--latency", nargs="+", default=["fast", "jitter", "tail", "spikes"])
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    if args.backend == "ray":
        start_ray(None)
    model = build_tiny_model(
        Path(tempfile.mkdtemp()) / "model", alphabet=GAME_ALPHABET, hidden_size=64, num_heads=2
    )
    engine = HFEngine(str(model))
    print(
        "| env steps | mode | wall s | episodes/s | engine calls | prompts/call | turn p50 s | turn p95 s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for latency in args.latency:
        envs = _envs(latency, args)
        warm = [(seed, seed) for seed in range(args.workers)]  # every worker up and called before the clock
        stream_episodes(
            engine.generate,
            envs,
            TrajectoryBuilder(engine.tokenizer),
            warm,
            SamplingParams(),
            max_turns=1,
            max_tokens=1024,
        )
        played = {}
        for mode in ("lockstep", "streaming"):
            r, played[mode] = _row(mode, engine, envs, args)
            print(
                f"| {latency} | {mode} | {r['wall']:.2f} | {r['eps']:.1f} | {r['calls']} | {r['batch']:.1f} "
                f"| {r['p50']:.3f} | {r['p95']:.3f} |",
                flush=True,
            )
        envs.shutdown()
        same = [e.traj.ids for e in played["lockstep"]] == [e.traj.ids for e in played["streaming"]]
        assert same, f"{latency}: streamed episodes differ from lockstep ones"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} | "
        f"{args.episodes} episodes, {args.workers} env workers ({args.backend}), hf engine in-process, "
        f"tiny model (hidden 64), {args.torch_threads} torch thread(s), {args.max_new_tokens} new tokens per "
        f"turn, median of {args.repeats}"
    )


if __name__ == "__main__":
    main()
