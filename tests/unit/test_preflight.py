"""What ``reroll validate`` and ``train`` check before starting anything: each problem names its key."""

import json
import sys
from types import SimpleNamespace

import pytest

from reroll.config.placement import cluster_problems
from reroll.config.schema import RunConfig
from reroll.pipelines.preflight import check_inputs

REWARDS = __name__  # this module's functions serve as user rewards


def with_threshold(prompt, response, row, *, threshold=0.5):
    raise AssertionError("never called by the checks")


def two_args(prompt, response):
    raise AssertionError("never called by the checks")


@pytest.fixture
def cfg_for(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")

    def make(**sections) -> RunConfig:
        data = {
            "pipeline": "rlvr",
            "output_dir": str(tmp_path / "runs" / "{name}"),
            "model": {"path": str(model)},
            "data": {"train_files": [str(train)], "prompt_template": "{question}="},
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 8},
        }
        for key, value in sections.items():
            data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
        return RunConfig.model_validate(data)

    return make


def _by_key(cfg: RunConfig) -> dict[str, str]:
    return {p.path: p.message for p in check_inputs(cfg)}


def test_a_good_config_has_no_problems(cfg_for):
    assert check_inputs(cfg_for()) == []


def test_reward_that_cannot_import_or_take_its_args(cfg_for):
    found = _by_key(cfg_for(reward={"fn": f"{REWARDS}:with_threshold", "args": {"treshold": 1}}))
    assert "'treshold' (did you mean 'threshold'?)" in found["reward.args"]
    found = _by_key(cfg_for(reward={"fn": f"{REWARDS}:two_args"}))
    assert "cannot be called as fn(prompt, response, row, **args)" in found["reward.fn"]
    assert "(prompt, response)" in found["reward.fn"]
    found = _by_key(cfg_for(reward={"fn": "no_such_module:f"}))
    assert "cannot import 'f' from 'no_such_module'" in found["reward.fn"]
    found = _by_key(cfg_for(reward={"fn": "exact_mach"}))
    assert "did you mean 'exact_match'" in found["reward.fn"]


def test_domain_rewards_are_named_by_their_key(cfg_for):
    domains = {"math": {"rewards": [{"fn": "exact_match"}, {"fn": "numeric_match", "args": {"tol": 1}}]}}
    found = _by_key(cfg_for(reward={"domains": domains, "default_domain": "math"}))
    assert "'tol' (did you mean 'rel_tol'?)" in found["reward.domains.math.rewards[1].args"]


def test_max_new_tokens_against_the_model_context(cfg_for):
    found = _by_key(cfg_for(rollout={"max_new_tokens": 10**12}))
    message = found["rollout.max_new_tokens"]
    assert "1000000000000" in message and "context length 64" in message and "config.json" in message


def test_rows_without_the_sft_target_field(cfg_for):
    found = _by_key(cfg_for(sft={"steps": 2, "target_template": "{solution}"}))
    assert "has no field 'solution'" in found["data.train_files[0]"]


def test_synthetic_files_that_do_not_exist_yet_are_not_problems(cfg_for, tmp_path):
    data = {"train_files": [str(tmp_path / "gen" / "train.jsonl")], "synthetic": {"n_train": 8}}
    assert check_inputs(cfg_for(data=data)) == []


def test_output_dir_that_is_a_file(cfg_for, tmp_path):
    (tmp_path / "taken").write_text("x")
    found = _by_key(cfg_for(output_dir=str(tmp_path / "taken")))
    assert "is a regular file" in found["output_dir"]


def test_roles_that_do_not_fit_the_cluster():
    cfg = RunConfig.model_validate(
        {
            "pipeline": "rlvr",
            "model": {"path": "org/model"},
            "data": {"train_files": ["x.jsonl"]},
            "roles": {"actor_train": {"world_size": 2, "num_gpus_per_worker": 1}},
        }
    )
    [(path, message)] = cluster_problems(cfg, {"CPU": 8.0, "GPU": 1.0}, "cuda")
    assert path == "roles" and "asks Ray for 2 GPU (actor_train 2) but the cluster has 1" in message
    assert cluster_problems(cfg, {"CPU": 8.0, "GPU": 2.0}, "cuda") == []
    pooled = cfg.model_copy(update={"placement": cfg.placement.model_copy(update={"devices": 4})})
    [(path, message)] = cluster_problems(pooled, {"CPU": 2.0}, "cpu")
    assert path == "placement" and "the pool needs 4 CPU (4 devices) but the Ray cluster has 2" in message


def test_the_cluster_is_checked_only_when_connected(cfg_for, monkeypatch):
    cfg = cfg_for(roles={"actor_infer": {"num_gpus_per_worker": 1}})
    fake = SimpleNamespace(is_initialized=lambda: False, cluster_resources=lambda: {"CPU": 2.0})
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert check_inputs(cfg) == []  # validate never starts or joins a cluster
    fake.is_initialized = lambda: True
    assert "asks Ray for 1 GPU" in _by_key(cfg)["roles"]
