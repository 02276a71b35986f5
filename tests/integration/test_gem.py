"""The agentic pipeline on a text game of the real gem-llm package (``gem:game:GuessTheNumber-v0-easy``).

A tiny ASCII model warm-starts on GEM's own random policy (``\\boxed{7}``: it learns the answer format,
not the game), then GRPO plays whole episodes against GEM's environment. The test replays every
episode through a fresh ``gem.make`` with the episode's seed and actions: GEM's observations and
rewards must come out exactly, so the episodes were GEM's, not a stand-in's.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from reroll.config.schema import RunConfig
from reroll.runtime.metrics import read_metrics
from tests.conftest import load_sections

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("gem") is None,
        reason="gem-llm is not installed: pip install 'reroll[gem]' (Python 3.10 or 3.11)",
    ),
]
GAME = "game:GuessTheNumber-v0-easy"  # a number in 1..10, 4 guesses, hints "higher" / "lower"


def _config(tmp_path: Path, **over) -> RunConfig:
    cfg = {
        "pipeline": "agentic",
        "name": "gem-guess",
        "output_dir": str(tmp_path / "{name}"),
        "seed": 0,
        "total_steps": 3,
        "model": {
            "path": str(tmp_path / "tiny-ascii"),
            "build_tiny": {"alphabet": "ascii", "hidden_size": 32, "num_layers": 1, "num_heads": 1, "seed": 0},
        },
        "agentic": {"env": f"gem:{GAME}", "max_turns": 4, "step_timeout_s": 10, "eval_episodes": 0,
                    "sft_policy": "random"},
        "sft": {"steps": 60, "batch_size": 8, "lr": 1e-2},
        "rollout": {"engine": "hf", "batch_size": 16, "group_size": 4, "max_new_tokens": 12, "temperature": 1.0},
        "algorithm": {"preset": "grpo", "kl_coef": 0.0},
        "optim": {"lr": 5e-4, "micro_batch_size": 16},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "actor_infer")},
        "logging": {"tensorboard": False, "sample_every": 0},
        "checkpoint": {"every": 0},
        "runtime": {"backend": "local"},
    }  # fmt: skip
    return load_sections(tmp_path, cfg, over)


def _replay(episode) -> tuple[list[str], list[float]]:
    """The episode's seed and actions played again on a fresh environment of GEM's own ``gem.make``."""
    import gem

    env = gem.make(GAME)
    states, rewards = [env.reset(seed=episode.seed)[0]], []
    actions = [m["content"] for m in episode.traj.messages if m["role"] == "assistant"]
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        rewards.append(float(reward))
        if terminated or truncated:
            break
        states.append(obs)
    return states, rewards


def test_grpo_trains_on_a_real_gem_game(tmp_path):
    from reroll.envs import make_env
    from reroll.pipelines.agentic import Agentic
    from reroll.pipelines.run import run

    played = []

    class Recorded(Agentic):  # the pipeline as it runs, keeping each step's episodes for the replay
        def step(self, roles, step):
            metrics = super().step(roles, step)
            played.append(list(self.last))
            return metrics

    start, cpu = time.monotonic(), time.process_time()
    result = run(Recorded, _config(tmp_path))
    rows = {r["step"]: r for r in read_metrics(result.run_dir)}
    print(f"{time.monotonic() - start:.1f} s, {time.process_time() - cpu:.1f} s CPU")
    for step in (1, 2, 3):
        print({k: round(v, 3) for k, v in rows[step].items() if k.startswith(("rollout/", "actor/grad"))})

    # GEM's environment played every episode: its texts and rewards, replayed exactly
    assert type(make_env(f"gem:{GAME}").env).__module__ == "gem.envs.game_env.guess_the_number"
    episodes = [e for step in played for e in step]
    assert len(played) == 3 and len(episodes) == 48
    assert all(e.error is None and e.finish in ("terminated", "truncated") for e in episodes)
    for e in episodes:
        states, rewards = _replay(e)
        assert e.states == states and e.rewards == rewards, (e.seed, e.traj.messages)
    assert all(e.states[0].startswith("You are playing Guess The Number.") for e in episodes)
    # the warm start taught GEM's answer format: few turns end in its format error (-0.1), and the
    # returns differ within the groups (wins 1.0, a last guess's 1 - distance / 9, format errors)
    turns = [r for e in episodes for r in e.rewards]
    assert turns.count(-0.1) < 0.3 * len(turns), turns
    assert any(e.success for e in episodes) and len({e.total_reward for e in episodes}) >= 4
    # and three GRPO steps trained on them
    for step in (1, 2, 3):
        assert "train/skipped" not in rows[step] and rows[step]["actor/grad_norm"] > 0, rows[step]
