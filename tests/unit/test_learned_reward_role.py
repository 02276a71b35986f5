"""The reward_model role scores whole texts in batches exactly as the sequence classifier scores each one
alone, and the critic started from the reward model (critic.model_path) carries its head."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers import Qwen2ForSequenceClassification

from reroll.config.schema import RunConfig
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.data.types import TrainBatch
from reroll.models.tiny import build_tiny_reward_model, char_tokenizer
from reroll.roles.critic import CriticWorker
from reroll.roles.learned_reward import LearnedRewardGroup


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    path = build_tiny_reward_model(tmp_path_factory.mktemp("rm"))
    return path


def _cfg(rm_path, critic: dict | None = None, **extra) -> RunConfig:
    return RunConfig.model_validate(
        {
            "critic": critic,
            "pipeline": "rlvr",
            "model": {"path": str(rm_path)},
            "data": {"train_files": ["unused.jsonl"]},
            "reward": {"model": {"path": str(rm_path), **extra}},
            "optim": {"micro_batch_size": 2},  # several micro-batches, rows of different lengths padded
            "runtime": {"backend": "local"},
        }
    )


def _alone(rm_path, text: str, eos: bool = True) -> float:
    model = Qwen2ForSequenceClassification.from_pretrained(rm_path).eval()
    tok = char_tokenizer(ARITHMETIC_ALPHABET)
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_batched_scores_equal_each_text_scored_alone(rm_path):
    group = LearnedRewardGroup(_cfg(rm_path))
    prompts, responses = ["12+34=", "1+1=", "9+9=", "30+12="], ["46", "2", "1888", ""]
    scores, truncated = group.score(prompts, responses)
    expected = [_alone(rm_path, p + r) for p, r in zip(prompts, responses)]
    assert_close(scores, torch.tensor(expected))
    assert not truncated.any()
    assert len(set(scores.tolist())) == 4  # the response matters


def test_template_eos_and_truncation(rm_path):
    group = LearnedRewardGroup(_cfg(rm_path, template="{response} {prompt}", append_eos=False, max_length=4))
    scores, truncated = group.score(["12+34="], ["46"])
    assert truncated.tolist() == [True]  # "46 12+34=" is 9 tokens: the last 4 are scored
    assert_close(scores, torch.tensor([_alone(rm_path, "+34=", eos=False)]))


def test_critic_started_from_the_reward_model_scores_like_it(rm_path):
    critic = CriticWorker(0, _cfg(rm_path, critic={"model_path": str(rm_path)}))
    tok = char_tokenizer(ARITHMETIC_ALPHABET)
    ids = torch.tensor([[*tok.encode("12+34=46", add_special_tokens=False), tok.eos_token_id]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        out = critic.forward(TrainBatch(ids, mask, mask, torch.zeros(1, dtype=torch.long)))
    # the value head is the reward model's score head (its bias, absent in the classifier, starts at 0)
    assert_close(float(out[0, -1, 0]), _alone(rm_path, "12+34=46"))
