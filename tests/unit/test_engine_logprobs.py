"""``rollout.logprobs``: the engine returns its sampled tokens' log-probs only where something reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from reroll.config.loader import ConfigError, load_config
from reroll.config.schema import RunConfig
from reroll.data.types import Completion, Rollout, Sample, SamplingParams, build_train_batch
from reroll.envs.trajectory import TrajectoryBuilder
from reroll.models.tiny import GAME_ALPHABET, char_tokenizer
from reroll.pipelines.common import sampling
from reroll.roles.chat_server import _params

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUICKSTART = EXAMPLES / "quickstart" / "arithmetic_grpo.yaml"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), False),  # rlvr, on-policy: only mismatch/* would read them
        (("algorithm.rollout_is=token",), True),  # the correction weighs tokens by them
        (("rollout.logprobs=true",), True),  # asked for, for mismatch/*
    ],
)
def test_auto_asks_for_log_probs_where_they_are_read(overrides, expected):
    cfg = load_config(QUICKSTART, RunConfig, list(overrides))
    assert cfg.engine_logprobs is expected
    assert sampling(cfg, n=4).logprobs is expected
    assert sampling(cfg, n=1, greedy=True).logprobs is False  # evaluation reads none


def test_agentic_runs_keep_them():
    """Its trajectories carry them (kl_in 'reward' advantages, the chat server's replies)."""
    cfg = load_config(EXAMPLES / "agentic" / "nim.yaml", RunConfig)
    assert cfg.rollout.logprobs == "auto" and cfg.engine_logprobs


def test_async_steps_turn_the_correction_and_so_the_log_probs_on():
    cfg = load_config(QUICKSTART, RunConfig, ["rollout.async_steps=1"])
    assert cfg.algorithm.rollout_is == "token" and cfg.engine_logprobs


def test_refusing_log_probs_the_correction_needs_is_one_clear_error():
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, RunConfig, ["rollout.logprobs=false", "algorithm.rollout_is=sequence"])
    message = str(info.value)
    assert "rollout.logprobs" in message and "algorithm.rollout_is 'sequence'" in message
    assert "set rollout.logprobs to 'auto'" in message


def test_a_batch_without_engine_log_probs_has_none():
    sample = Sample(uid="u", prompt="p", row={})
    rollouts = [Rollout(sample, 0, Completion([1, 2], [3, 4], "", [], "stop")) for _ in range(2)]
    batch = build_train_batch(rollouts, pad_token_id=0)
    assert batch.rollout_logprobs is None  # not zeros that mismatch/* or rollout_is would read
    assert batch.response_mask.sum() == 4


def test_a_trajectory_takes_a_response_without_log_probs():
    tok = char_tokenizer(GAME_ALPHABET)
    builder = TrajectoryBuilder(tok)
    traj = builder.start_episode("ab")
    ids = tok.encode("ba", add_special_tokens=False)
    builder.add_response(traj, ids, [], "ba")
    assert traj.policy_tokens == len(ids) and len(traj.logprobs) == len(traj.ids)
    with pytest.raises(ValueError, match="2 response ids but 1 log-probs"):
        builder.add_response(traj, ids, [-0.1], "ba")


def test_the_chat_endpoint_asks_for_them_whatever_its_defaults():
    """``reroll serve`` takes its defaults from the rollout section, where 'auto' may have left them
    out; its replies and recorded trajectories carry them."""
    assert _params({"max_tokens": 4}, SamplingParams(logprobs=False)).logprobs is True


def test_an_agentic_kl_in_the_reward_needs_them():
    with pytest.raises(ConfigError) as info:
        load_config(
            EXAMPLES / "agentic" / "nim.yaml",
            RunConfig,
            ["rollout.logprobs=false", "algorithm.kl_in=reward", "algorithm.kl_coef=0.05"],
        )
    assert "rollout.logprobs" in str(info.value) and "algorithm.kl_in to 'loss'" in str(info.value)
