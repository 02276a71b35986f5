"""The episode runner with a scripted stand-in for the engine: one engine call per turn, limits, batching."""

from __future__ import annotations

import pytest
import torch

from reroll.config.schema import RunConfig
from reroll.data.types import Completion
from reroll.envs.trajectory import TrajectoryBuilder
from reroll.models.tiny import GAME_ALPHABET, char_tokenizer
from reroll.roles.env import EnvGroup, episode_batch, run_episodes


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(GAME_ALPHABET)


def _envs(**agentic) -> EnvGroup:
    cfg = RunConfig.model_validate(
        {
            "pipeline": "agentic",
            "model": {"path": "unused"},
            "agentic": {"env": "nim", **agentic},
            "roles": {"env": {"world_size": 2}},
            "runtime": {"backend": "local"},
        }
    )
    return EnvGroup(cfg)


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
