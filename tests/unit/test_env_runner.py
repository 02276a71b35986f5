"""The episode runners with scripted stand-ins for the engine: one engine call per turn, limits,
batching; streamed episodes equal lockstep ones token for token and do not wait for a slow environment."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from reroll.config.schema import RunConfig
from reroll.data.types import Completion, SamplingParams
from reroll.envs.nim import Nim
from reroll.envs.trajectory import TrajectoryBuilder
from reroll.models.tiny import GAME_ALPHABET, char_tokenizer
from reroll.roles.batcher import Batcher
from reroll.roles.env import EnvGroup, episode_batch, run_episodes, stream_episodes


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(GAME_ALPHABET)


def _envs(backend: str = "local", **agentic) -> EnvGroup:
    cfg = RunConfig.model_validate(
        {
            "pipeline": "agentic",
            "model": {"path": "unused"},
            "agentic": {"env": "nim", **agentic},
            "roles": {"env": {"world_size": 2}},
            "runtime": {"backend": backend},
        }
    )
    return EnvGroup(cfg)


class SlowNim(Nim):
    """Nim whose steps for ``slow_seed`` take ``sleep_s`` and for ``broken_seed`` raise."""

    def __init__(self, sleep_s: float = 0.0, slow_seed: int = -1, broken_seed: int = -1) -> None:
        super().__init__()
        self.sleep_s, self.slow_seed, self.broken_seed, self.seed = sleep_s, slow_seed, broken_seed, None

    def reset(self, seed=None):
        self.seed = seed
        return super().reset(seed)

    def step(self, action):
        if self.seed == self.broken_seed:
            raise RuntimeError("the environment broke")
        if self.seed == self.slow_seed:
            time.sleep(self.sleep_s)
        return super().step(action)


class ByPrompt:
    """A deterministic engine: the move and log-probs are functions of the prompt alone (as greedy
    decoding is), so an episode's tokens do not depend on which prompts share its call."""

    def __init__(self, tok):
        self.tok, self.sizes, self.lock = tok, [], threading.Lock()

    def __call__(self, prompts, params):
        with self.lock:
            self.sizes.append(len(prompts))
        out = []
        for p in prompts:
            move = str(1 + sum(p) % 3)
            ids = [*self.tok.encode(move, add_special_tokens=False), self.tok.eos_token_id]
            out.append([Completion(list(p), ids, move, [-(len(p) % 7) / 8, -0.5], "stop")])
        return out


class TakeOne:
    """Always answers "1" (and eos); records the prompts of each call."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __call__(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        ids = [*self.tok.encode("1", add_special_tokens=False), self.tok.eos_token_id]
        return [[Completion(list(p), ids, "1", [-0.25, -0.5], "stop")] for p in prompts]


def test_episodes_batch_all_live_turns_into_one_engine_call(tok):
    from reroll.data.types import SamplingParams

    engine, builder = TakeOne(tok), TrajectoryBuilder(tok)
    starts = [(3, 0), (3, 0), (8, 1), (8, 1)]
    episodes = run_episodes(
        engine, _envs(), builder, starts, SamplingParams(max_new_tokens=2), max_turns=20, max_tokens=500
    )
    # one call per turn for every live episode: the first call has all four
    assert len(engine.calls[0]) == 4 and len(engine.calls) == max(e.traj.turns for e in episodes)
    assert [len(c) for c in engine.calls] == sorted((len(c) for c in engine.calls), reverse=True)
    # same seed, same policy: the two episodes of a group are identical
    assert episodes[0].traj.ids == episodes[1].traj.ids and episodes[0].rewards == episodes[1].rewards
    assert all(e.finish == "terminated" and e.error is None for e in episodes)
    # each prompt the engine saw is the trajectory so far, token for token
    first = episodes[0]
    assert engine.calls[1][0] == first.traj.ids[: len(engine.calls[1][0])]
    assert first.states[0].startswith("pile ")

    batch = episode_batch(episodes, tok.pad_token_id)
    turns = first.traj.turns
    assert batch.response_mask[0].sum() == 2 * turns  # "1" and eos per turn, nothing else
    assert batch.step_ids[0][batch.response_mask[0]].tolist() == [k for k in range(turns) for _ in (0, 1)]
    assert torch.equal(batch.rollout_logprobs[0][batch.response_mask[0]], torch.tensor([-0.25, -0.5] * turns))
    assert batch.rewards.tolist() == [e.total_reward for e in episodes]
    assert (batch.step_states[0, :turns] >= 0).all()


def test_turn_limit_and_token_budget(tok):
    from reroll.data.types import SamplingParams

    builder, params = TrajectoryBuilder(tok), SamplingParams(max_new_tokens=2)
    [ep] = run_episodes(TakeOne(tok), _envs(), builder, [(3, 0)], params, max_turns=1, max_tokens=500)
    assert ep.finish == "turn_limit" and ep.traj.turns == 1
    [ep] = run_episodes(TakeOne(tok), _envs(), builder, [(3, 0)], params, max_turns=9, max_tokens=15)
    assert ep.finish == "token_budget" and ep.traj.turns == 1 and len(ep.traj.ids) + 2 > 15


def _fields(e):
    t = e.traj
    return (t.ids, t.policy, t.logprobs, t.turn, e.rewards, e.states, e.finish, e.success, e.error)


def test_streamed_episodes_equal_lockstep_ones_token_for_token(tok):
    env = {"env": "tests.unit.test_env_runner:SlowNim", "env_config": {"broken_seed": 5}}
    starts = [(seed, seed // 2) for seed in range(16)]
    params, limits = SamplingParams(max_new_tokens=2), {"max_turns": 3, "max_tokens": 31}
    builder = TrajectoryBuilder(tok)
    lockstep = run_episodes(ByPrompt(tok), _envs(**env), builder, starts, params, **limits)
    engine = ByPrompt(tok)
    streamed = stream_episodes(engine, _envs(streaming=True, **env), builder, starts, params, **limits)
    assert [_fields(e) for e in streamed] == [_fields(e) for e in lockstep]
    # the comparison covers every way an episode ends: won/lost, the broken env, both limits
    assert {e.finish for e in streamed} == {"terminated", "error", "turn_limit", "token_budget"}
    assert [e.seed for e in streamed if e.error] == [5]  # the broken env ended only its own episode
    assert sum(engine.sizes) == sum(e.traj.turns for e in streamed)  # one prompt per turn, none lost
    assert max(engine.sizes) > 1  # turns that arrived together shared engine calls


def test_a_slow_environment_does_not_hold_back_the_others(tok):
    # episodes 1 and 3 share env worker 1; seed 3's every step takes 0.6 s
    env = {"env": "tests.unit.test_env_runner:SlowNim", "env_config": {"sleep_s": 0.6, "slow_seed": 3}}
    starts = [(seed, seed) for seed in range(4)]
    params, limits = SamplingParams(max_new_tokens=2), {"max_turns": 3, "max_tokens": 500}
    builder = TrajectoryBuilder(tok)
    lockstep = run_episodes(ByPrompt(tok), _envs(**env), builder, starts, params, **limits)
    start = time.monotonic()
    streamed = stream_episodes(ByPrompt(tok), _envs(streaming=True, **env), builder, starts, params, **limits)
    wall = time.monotonic() - start
    slow, fast = streamed[3], [streamed[i] for i in range(3)]
    assert slow.traj.turns >= 2 and all(e.traj.turns >= 2 for e in fast)
    # lockstep: every turn of a fast episode taken while the slow one lived waited for its step
    assert all(s >= 0.6 for e in lockstep[:3] for s in e.turn_seconds[: slow.traj.turns])
    # streamed: a fast episode played all its turns in less than one slow step
    assert all(sum(e.turn_seconds) < 0.45 for e in fast), [e.turn_seconds for e in fast]
    assert wall < 0.6 * slow.traj.turns + 0.5  # the slow episode's own steps, little else
    assert [_fields(e) for e in streamed] == [_fields(e) for e in lockstep]


def test_batcher_waits_for_the_expected_callers_at_most_its_window():
    sizes, results = [], {}
    engine = lambda prompts, params: sizes.append(len(prompts)) or [[p] for p in prompts]  # noqa: E731
    batcher = Batcher(engine, wait_s=5.0, expect=3)
    ask = lambda i: results.__setitem__(i, batcher.submit([i], SamplingParams()))  # noqa: E731
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(2.0)
    assert sizes == [3] and results == {0: [[0]], 1: [[1]], 2: [[2]]}  # all three came: sent at once
    assert time.monotonic() - start < 2.0
    batcher.leave()  # one caller is done: two are expected now
    batcher.leave()
    assert batcher.submit([7], SamplingParams()) == [[7]] and sizes == [3, 1]  # the one expected is here
    batcher.close()
    short = Batcher(engine, wait_s=0.2, expect=2)
    start = time.monotonic()
    assert short.submit([1], SamplingParams()) == [[1]]  # the other never comes: sent after the window
    assert 0.2 <= time.monotonic() - start < 1.5
    short.close()
