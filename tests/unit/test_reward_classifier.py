"""classifier_score: a tiny random Qwen2ForSequenceClassification saved locally scores deterministically (the reward once named reward_model, which still works)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.models.tiny import char_tokenizer
from reroll.rewards.classifier import classifier_score, load_classifier


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    tok = char_tokenizer(ARITHMETIC_ALPHABET)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=64, num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("rm")
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_scores_are_deterministic_and_depend_on_the_response(rm_path):
    a = classifier_score("12+34=", "46", {}, path=rm_path)
    load_classifier.cache_clear()  # a fresh load gives the same score
    b = classifier_score("12+34=", "46", {}, path=rm_path)
    c = classifier_score("12+34=", "99999", {}, path=rm_path)
    assert a.score == b.score and a.score != c.score
    assert a.details == {"truncated": 0}


def test_long_inputs_are_truncated_from_the_left(rm_path):
    r = classifier_score("1" * 100, "2", {}, path=rm_path, max_length=16)
    assert r.details["truncated"] == 1
