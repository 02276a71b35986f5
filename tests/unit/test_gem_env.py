"""GEM's environments through ``reroll.envs.gem``: first what the adapter adds (own random numbers, the
success flag) on small stand-ins, then the real gem-llm package's games (skipped without it)."""

from __future__ import annotations

import importlib.util
import random
import threading
import time

import numpy as np
import pytest

from reroll.config.schema import RunConfig
from reroll.envs import make_env
from reroll.envs.check import check_env
from reroll.envs.gem import GemEnv
from reroll.errors import UserError
from reroll.pipelines.preflight import check_inputs

NEEDS_GEM = pytest.mark.skipif(
    importlib.util.find_spec("gem") is None,
    reason="gem-llm is not installed: pip install 'reroll[gem]' (Python 3.10 or 3.11)",
)
GUESS = "game:GuessTheNumber-v0-easy"  # 1..10 in 4 turns


class _GlobalRandomGame:
    """What GEM's games do: reseed the global generators in reset, then draw from them (here with a
    pause in between, so that concurrent resets interleave)."""

    def reset(self, seed=None):
        random.seed(seed)
        np.random.seed(seed)
        time.sleep(0.01)
        self.target = (random.randint(1, 10**9), int(np.random.randint(10**9)))
        return f"target {self.target}", {}

    def step(self, action):
        return f"moved {random.random()}", 0.0, False, False, {}


def _concurrent_resets(envs, seed=0):
    out = [None] * len(envs)

    def reset(i):
        out[i] = envs[i].reset(seed=seed)[0]

    threads = [threading.Thread(target=reset, args=(i,)) for i in range(len(envs))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def test_each_gem_env_draws_its_own_random_numbers():
    # the bare games: 8 concurrent resets with seed 0 give different games
    assert len(set(_concurrent_resets([_GlobalRandomGame() for _ in range(8)]))) > 1
    random.seed(123)
    expected = random.Random(123).random()
    wrapped = [GemEnv(_GlobalRandomGame(), "game:Stand-in") for _ in range(8)]
    firsts = _concurrent_resets(wrapped)
    assert len(set(firsts)) == 1  # one game for one seed, whatever ran beside it
    assert random.random() == expected  # the process's own generator was left where it was
    # an episode's moves depend on its seed and actions only: interleaved steps, same sequences
    a, b = wrapped[0], wrapped[1]
    a.reset(seed=5), b.reset(seed=5)
    moves_a, moves_b = [], []
    for _ in range(3):
        moves_a.append(a.step("x")[0])
        GemEnv(_GlobalRandomGame(), "other").reset(seed=9)
        moves_b.append(b.step("x")[0])
    assert moves_a == moves_b


class _Scripted:
    def __init__(self, rewards, info=None):
        self.rewards, self.info = rewards, info or {}

    def reset(self, seed=None):
        self.turn = 0
        return "start", {}

    def step(self, action):
        self.turn += 1
        last = self.turn == len(self.rewards)
        return "obs", self.rewards[self.turn - 1], last, False, dict(self.info) if last else {}


@pytest.mark.parametrize(
    ("rewards", "info", "success"),
    [
        ([0.0, 0.0, 0.6], {}, False),  # GuessTheNumber's last-turn partial reward is not a win
        ([0.0, 1.0], {}, True),
        ([0.25, 0.0, 0.25, 0.5], {}, True),  # Mastermind-style shaped rewards summing to 1
        ([-0.1], {}, False),  # a format error
        ([1.0], {"success": False}, False),  # the environment's own flag wins
    ],
)
def test_a_gem_episode_succeeds_when_its_return_reaches_one(rewards, info, success):
    env = GemEnv(_Scripted(rewards, info), "game:Stand-in")
    for _ in range(2):  # a second episode starts from a return of 0
        env.reset(seed=0)
        out = [env.step("a") for _ in rewards]
        assert [o[4].get("success") for o in out] == [None] * (len(rewards) - 1) + [success]


def _agentic(tmp_path, env: str, env_config=None) -> RunConfig:
    return RunConfig.model_validate(
        {
            "pipeline": "agentic",
            "output_dir": str(tmp_path / "{name}"),
            "model": {"path": str(tmp_path / "m"), "build_tiny": {"alphabet": "ascii"}},
            "agentic": {"env": env, "env_config": env_config or {}},
            "rollout": {"engine": "hf"},
            "runtime": {"backend": "local"},
        }
    )


def test_validate_names_the_gem_extra_when_gem_llm_is_missing(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gem" else real(name, *a)
    )
    problems = {p.path: p.message for p in check_inputs(_agentic(tmp_path, f"gem:{GUESS}"))}
    assert set(problems) == {"agentic.env"}, problems
    assert f"is 'gem:{GUESS}': GEM's environments need the gem-llm package" in problems["agentic.env"]
    assert "pip install 'reroll[gem]'" in problems["agentic.env"]
    assert check_inputs(_agentic(tmp_path, "nim")) == []


@NEEDS_GEM
def test_validate_checks_the_gem_id_and_options(tmp_path):
    assert check_inputs(_agentic(tmp_path, f"gem:{GUESS}", {"max_turns": 3})) == []
    [bad_id] = check_inputs(_agentic(tmp_path, "gem:game:GuessTheNumber-v0"))
    assert "did you mean 'game:GuessTheNumber-v0-hard' or 'game:GuessTheNumber-v0-easy'" in bad_id.message
    [bad_option] = check_inputs(_agentic(tmp_path, f"gem:{GUESS}", {"max_turn": 3}))
    assert (
        "has no option 'max_turn' (GEM would ignore it); its options are min_number=1, max_number=10, "
        in (bad_option.message)
    )


def _guess(env: GemEnv, n: int):
    return env.step(f"my guess: \\boxed{{{n}}}")


@NEEDS_GEM
def test_the_real_guess_the_number_game_and_its_success():
    env = make_env(f"gem:{GUESS}")
    assert isinstance(env, GemEnv)
    assert type(env.env).__module__ == "gem.envs.game_env.guess_the_number"  # GEM's own class
    obs, _ = env.reset(seed=3)
    assert "You are playing Guess The Number" in obs and "between 1 and 10" in obs
    target = env.env.game_number
    # binary search wins: the return is 1.0 and the episode a success
    low, high, turns = 1, 10, []
    while True:
        guess = (low + high) // 2
        obs, reward, terminated, truncated, info = _guess(env, guess)
        turns.append(reward)
        if terminated or truncated:
            break
        low, high = (guess + 1, high) if "higher" in obs else (low, guess - 1)
    assert guess == target and "Congratulations" in obs
    assert sum(turns) == 1.0 and info["success"] is True
    # four wrong guesses: GEM's last reward is positive (1 - distance / 9) and still not a success
    env.reset(seed=3)
    wrong = [n for n in range(1, 11) if n != target][:4]
    out = [_guess(env, n) for n in wrong]
    assert [o[2] for o in out] == [False, False, False, True]
    assert out[-1][1] == pytest.approx(1 - abs(wrong[-1] - target) / 9) and out[-1][1] > 0
    assert out[-1][4]["success"] is False


@NEEDS_GEM
def test_env_check_plays_real_gem_games_with_their_random_policy(capsys):
    from reroll.cli import main

    assert main(["env-check", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert "nim" in listed and f"gem:{GUESS}" in listed and "gem:game:Sokoban-v0-hard" in listed
    report = check_env(f"gem:{GUESS}", episodes=20)
    # random guesses find the number in 4 turns far less often than the bare "reward > 0" rule said (0.95)
    assert report.total_turns > 20 and report.success_rate < 0.6
    assert "\\boxed{" in report.transcript[1]
    with pytest.raises(UserError, match="has no random policy"):
        check_env("gem:game:Sudoku-v0-easy", episodes=1)


def test_the_gem_extra_pins_the_version_the_adapter_names():
    from pathlib import Path

    from reroll.envs.gem import GEM_VERSION

    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    [line] = pyproject["project"]["optional-dependencies"]["gem"]
    assert line.startswith(f"gem-llm=={GEM_VERSION};")
