"""The agentic pipeline end to end on tiny models: failing environments, resume, streamed episodes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from reroll.config.schema import RunConfig
from reroll.runtime.metrics import read_metrics
from tests.conftest import load_sections

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


class Countdown:
    """Four turns, any answer. Seeds 4k crash on the third step, 4k+1 hang on the second, 4k+2 win, 4k+3 lose."""

    def reset(self, seed=None):
        self.seed, self.turn = seed, 0
        return "pile 4", {}

    def step(self, action):
        self.turn += 1
        if self.seed % 4 == 0 and self.turn == 3:
            raise RuntimeError("the environment broke on step 3")
        if self.seed % 4 == 1 and self.turn == 2:
            time.sleep(30)
        won = self.turn == 4 and self.seed % 4 == 2
        return f"pile {4 - self.turn}", float(won), self.turn == 4, False, {"success": won}


class Tally:
    """2 + seed % 3 turns, any answer; each observation depends on the seed and the answer's length
    (episodes of different lengths, whose prompts differ: streamed calls batch them differently)."""

    def reset(self, seed=None):
        self.seed, self.turn = seed, 0
        return f"pile {seed % 23}", {}

    def step(self, action):
        self.turn += 1
        done = self.turn == 2 + self.seed % 3
        return (
            f"pile {(len(action) * 7 + self.seed) % 19}",
            float(done and self.seed % 2 == 0),
            done,
            False,
            {},
        )


@pytest.fixture(scope="module")
def game_model(tmp_path_factory):
    from reroll.models.tiny import GAME_ALPHABET, build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("game") / "model", alphabet=GAME_ALPHABET, hidden_size=64, num_heads=2
    )


def _config(tmp_path: Path, model: Path, **over) -> RunConfig:
    cfg = {
        "pipeline": "agentic",
        "name": "a",
        "output_dir": str(tmp_path / "{name}"),
        "total_steps": 1,
        "model": {"path": str(model)},
        "agentic": {"env": "tests.integration.test_agentic:Countdown", "step_timeout_s": 1.0,
                    "eval_episodes": 0, "max_turns": 6},
        "algorithm": {"adv_estimator": "reinforce_pp"},  # whitened over the batch: seed 6 vs seed 7
        "rollout": {"batch_size": 8, "group_size": 2, "max_new_tokens": 2},
        "optim": {"lr": 1e-3, "micro_batch_size": 8},
        "roles": {r: {"torch_threads": 1} for r in ("actor_train", "actor_infer")},
        "logging": {"tensorboard": False, "sample_every": 0},
        "runtime": {"backend": "local"},
    }  # fmt: skip
    return load_sections(tmp_path, cfg, over)


@pytest.mark.parametrize("streaming", [False, True], ids=["lockstep", "streaming"])
def test_crashing_and_hanging_envs_end_their_episodes_and_the_step_completes(
    tmp_path, game_model, caplog, streaming
):
    from reroll.pipelines.agentic import Agentic
    from reroll.pipelines.run import run

    start = time.monotonic()
    over = {"agentic": {"streaming": streaming}}
    result = run(Agentic, _config(tmp_path, game_model, **over))
    assert time.monotonic() - start < 60
    [row] = [r for r in read_metrics(result.run_dir) if r["step"] == 1]
    # step 1 plays seeds 4..7, two episodes each: seed 4 crashes, seed 5 hangs, 6 wins and 7 loses
    assert row["env/errors"] == pytest.approx(0.5) and row["env/timeouts"] == pytest.approx(0.25)
    assert row["env/finish_terminated"] == pytest.approx(0.5)
    assert row["rollout/success"] == pytest.approx(0.25)
    assert "train/skipped" not in row and row["actor/grad_norm"] > 0  # the update ran on the other four
    # every policy turn went through the engine once; lockstep's first call held all eight episodes
    assert row["agentic/engine_calls"] * row["agentic/engine_batch_mean"] == pytest.approx(
        8 * row["rollout/turns"]
    )
    assert row["agentic/engine_batch_max"] == 8 or streaming
    assert 0 < row["agentic/turn_latency_p50"] <= row["agentic/turn_latency_p95"]
    assert row["filter/kept_samples"] == 4
    errors = [r.getMessage() for r in caplog.records if "environment error" in r.getMessage()]
    assert sum("RuntimeError: the environment broke on step 3" in m for m in errors) == 2
    assert sum("no answer within 1 s" in m for m in errors) == 2
    assert result.checkpoint is not None and (result.checkpoint / "model" / "config.json").exists()


def test_resume_continues_from_the_last_checkpoint(tmp_path, game_model):
    from reroll.pipelines.agentic import Agentic
    from reroll.pipelines.run import run

    over = {"agentic": {"env": "nim", "eval_episodes": 4}, "algorithm": {"adv_estimator": "gigpo"}}
    first = run(Agentic, _config(tmp_path, game_model, **over))
    assert first.checkpoint is not None and first.checkpoint.name == "step_000001"
    second = run(Agentic, _config(tmp_path, game_model, total_steps=2, **over), resume=True)
    assert second.checkpoint is not None and second.checkpoint.name == "step_000002"
    steps = [r["step"] for r in read_metrics(second.run_dir)]
    assert steps == [0, 1, 2]  # no second step-0 evaluation: the run continued


def _fields(e):
    t = e.traj
    return (t.ids, t.policy, t.logprobs, t.turn, e.rewards, e.states, e.finish, e.success, e.error)


def test_streamed_greedy_episodes_equal_lockstep_ones_with_the_hf_engine(game_model):
    from reroll.data.types import SamplingParams
    from reroll.engines.hf import HFEngine
    from reroll.envs.trajectory import TrajectoryBuilder
    from reroll.roles.env import run_episodes, stream_episodes
    from tests.unit.test_env_runner import _envs

    engine = HFEngine(str(game_model))
    builder = TrajectoryBuilder(engine.tokenizer)
    env = {"env": "tests.integration.test_agentic:Tally"}
    starts = [(seed, seed) for seed in range(12)]
    params, limits = SamplingParams(max_new_tokens=3, temperature=0.0), {"max_turns": 4, "max_tokens": 200}
    lockstep = run_episodes(engine.generate, _envs(**env), builder, starts, params, **limits)
    sizes = []

    def generate(prompts, p):
        sizes.append(len(prompts))
        return engine.generate(prompts, p)

    streamed = stream_episodes(generate, _envs(streaming=True, **env), builder, starts, params, **limits)
    # tokens, rewards, states and endings exactly; the log-probs to float rounding (a prompt's padding
    # differs with the other prompts of its call: measured differences up to 2.4e-7)
    tokens = lambda e: (e.traj.ids, e.traj.policy, e.traj.turn, e.rewards, e.states, e.finish)  # noqa: E731
    assert [tokens(e) for e in streamed] == [tokens(e) for e in lockstep]
    for s, a in zip(streamed, lockstep):
        assert s.traj.logprobs == pytest.approx(a.traj.logprobs)
    assert {e.traj.turns for e in streamed} == {2, 3, 4}
    assert sum(sizes) == sum(e.traj.turns for e in streamed)


def test_streamed_episodes_on_ray_env_workers_do_not_wait_for_a_slow_one():
    """Ray env workers run several episodes' steps at once: episode 1 shares worker 1 with the slow
    episode 3 and still plays all its turns within one of its steps."""
    from reroll.data.types import SamplingParams
    from reroll.envs.trajectory import TrajectoryBuilder
    from reroll.models.tiny import GAME_ALPHABET, char_tokenizer
    from reroll.roles.env import run_episodes, stream_episodes
    from reroll.runtime.actors import start_ray
    from tests.unit.test_env_runner import ByPrompt, _envs

    start_ray(None)
    tok = char_tokenizer(GAME_ALPHABET)
    env = {"env": "tests.unit.test_env_runner:SlowNim", "env_config": {"sleep_s": 1.0, "slow_seed": 3}}
    starts = [(seed, seed) for seed in range(4)]
    params, limits = SamplingParams(max_new_tokens=2), {"max_turns": 3, "max_tokens": 500}
    builder = TrajectoryBuilder(tok)
    envs = _envs("ray", streaming=True, **env)  # the lockstep runner plays on them as on any workers
    try:  # both workers started and called once (a first call pays the worker's start)
        stream_episodes(ByPrompt(tok), envs, builder, starts[:2], params, **limits)
        t0 = time.monotonic()
        streamed = stream_episodes(ByPrompt(tok), envs, builder, starts, params, **limits)
        t1 = time.monotonic()
        lockstep = run_episodes(ByPrompt(tok), envs, builder, starts, params, **limits)
        print(f"streamed {t1 - t0:.2f} s, lockstep {time.monotonic() - t1:.2f} s")
    finally:
        envs.shutdown()
    assert streamed[3].traj.turns >= 2 and streamed[1].traj.turns >= 2
    assert all(sum(e.turn_seconds) < 0.9 for e in streamed[:3]), [e.turn_seconds for e in streamed]
    assert all(s >= 1.0 for s in lockstep[1].turn_seconds[:2])
    assert [_fields(e) for e in streamed] == [_fields(e) for e in lockstep]
