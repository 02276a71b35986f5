"""classifier_score: a tiny random Qwen2ForSequenceClassification saved locally scores deterministically (the reward once named reward_model, which still works)."""

from __future__ import annotations

import pytest

from reroll.models.tiny import build_tiny_reward_model
from reroll.rewards.classifier import classifier_score, load_classifier


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    path = build_tiny_reward_model(tmp_path_factory.mktemp("rm"))
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
