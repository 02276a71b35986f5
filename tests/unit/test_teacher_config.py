"""The distill section and reward.model: strict checks, teacher routing, and what `reroll validate` catches."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from reroll.config.loader import ConfigError
from reroll.config.schema import RunConfig
from reroll.config.teacher import DistillConfig, teacher_for
from reroll.data.arithmetic import ARITHMETIC_ALPHABET
from reroll.models.tiny import build_tiny_model, char_tokenizer
from reroll.pipelines.preflight import check_inputs


def _problems(cfg: RunConfig) -> dict[str, str]:
    return {p.path: p.message for p in cfg.check()}


@pytest.fixture
def make(tmp_path):
    train = tmp_path / "train.jsonl"
    rows = [
        {"question": "1+1", "answer": "2", "domain": "math"},
        {"question": "2+2", "answer": "4", "domain": "chat"},
    ]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def make(**sections) -> RunConfig:
        data = {
            "pipeline": "distill",
            "output_dir": str(tmp_path / "runs" / "{name}"),
            "model": {"path": str(tmp_path)},
            "data": {"train_files": [str(train)], "prompt_template": "{question}="},
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 8},
            "distill": {"teachers": {"math": {"model_path": str(tmp_path)}}},
        }
        for key, value in sections.items():
            merge = isinstance(data.get(key), dict) and isinstance(value, dict)
            data[key] = {**data[key], **value} if merge else value
        return RunConfig.model_validate(data)

    return make


def test_routing_by_tag_and_default():
    one = DistillConfig.model_validate({"teachers": {"a": {"model_path": "x/y"}}})
    assert teacher_for(one, "anything") == "a"  # a single teacher takes every row
    two = DistillConfig.model_validate(
        {"teachers": {"a": {"model_path": "x/y", "tags": ["m", "g"]}, "b": {"model_path": "x/z"}}}
    )
    assert teacher_for(two, "g") == "a" and teacher_for(two, "b") == "b"
    with pytest.raises(ValueError, match="'chat', which no teacher lists"):
        teacher_for(two, "chat")
    with_default = two.model_copy(update={"default_teacher": "b"})
    assert teacher_for(with_default, "chat") == "b"


def test_section_checks_name_their_keys(make):
    assert _problems(make()) == {}
    problems = _problems(
        make(distill={"top_k": 8, "default_teacher": "nobody"}, rollout={"temperature": 0.7})
    )
    assert "not used by mode 'on_policy'" in problems["distill.top_k"]
    assert _problems(make(distill={"on_policy_loss": "topk", "top_k": 8})) == {}
    assert (
        "mode 'on_policy' only"
        in _problems(make(distill={"mode": "offline", "on_policy_loss": "topk"}))["distill.on_policy_loss"]
    )
    assert "'nobody' is not one of the teachers ['math']" in problems["distill.default_teacher"]
    assert "set rollout.temperature: 1.0" in problems["rollout.temperature"]
    assert _problems(make(distill={"mode": "offline", "top_k": 8}, rollout={"temperature": 0.7})) == {}
    twice = make(
        distill={
            "teachers": {"a": {"model_path": "x/y", "tags": ["m"]}, "b": {"model_path": "x/z", "tags": ["m"]}}
        }
    )
    assert "'m' is also routed to 'a'" in _problems(twice)["distill.teachers.b.tags"]
    assert "needs a `distill:` section" in _problems(make(distill=None))["distill"]
    with pytest.raises(ValidationError, match="distill"):  # another pipeline's section (the loader names it)
        make(pipeline="rlvr")
    assert "pipeline 'rlvr' only" in _problems(make(reward={"model": {"path": "x/y"}}))["reward.model"]
    with pytest.raises(ValueError, match="Extra inputs"):
        make(distill={"temperatur": 1.0})  # strict: a misspelt key is an error


def test_validate_checks_rows_routes_tokenizers_and_the_reward_model(make, tmp_path):
    student = build_tiny_model(
        tmp_path / "student", alphabet=ARITHMETIC_ALPHABET, hidden_size=32, num_layers=1, num_heads=1
    )
    other = build_tiny_model(tmp_path / "other", alphabet="0123", hidden_size=32, num_layers=1, num_heads=1)
    teachers = {"math": {"model_path": str(other)}, "x": {"model_path": str(student), "tags": ["x"]}}
    cfg = make(model={"path": str(student)}, distill={"teachers": teachers})
    problems = {p.path: p.message for p in check_inputs(cfg)}
    assert "differs from the student's" in problems["distill.teachers.math.model_path"]
    missing = make(distill={"teachers": {"a": {"model_path": "./nowhere"}}})
    assert (
        "neither an existing directory"
        in {p.path: p.message for p in check_inputs(missing)}["distill.teachers.a.model_path"]
    )
    assert "distill.teachers.x.model_path" not in problems
    assert "row 2: a row is tagged domain 'chat', which no teacher lists" in problems["data.train_files[0]"]

    rlhf = make(
        pipeline="rlvr", distill=None, model={"path": str(student)}, reward={"model": {"path": str(student)}}
    )
    problems = {p.path: p.message for p in check_inputs(rlhf)}
    assert "not a sequence-classification reward model" in problems["reward.model.path"]
    tok = char_tokenizer(ARITHMETIC_ALPHABET)
    rm_cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(rm_cfg).save_pretrained(tmp_path / "rm")
    rm = {"model": {"path": str(tmp_path / "rm")}}
    ok = make(pipeline="rlvr", distill=None, model={"path": str(student)}, reward=rm)
    assert "reward.model.path" not in {p.path for p in check_inputs(ok)}


def test_validate_cli_exits_2_naming_the_key(make, tmp_path, capsys):
    from reroll.cli import main

    cfg = make(distill={"top_k": 8})
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg.model_dump(mode="json", exclude_unset=True)))
    assert main(["validate", str(path)]) == 2
    assert "distill.top_k" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        from reroll.config.loader import load_config

        load_config(path, RunConfig)
