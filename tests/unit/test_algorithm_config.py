"""AlgorithmConfig: presets, explicit values surviving presets, combination checks, registry, imports, docs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from reroll.algorithms import UnknownAlgorithmError, lookup, names
from reroll.algorithms.objective import ADV_ESTIMATOR_PARAMS, POLICY_LOSS_PARAMS
from reroll.config.algorithm import (
    PRESETS,
    AdvEstimatorName,
    AlgorithmConfig,
    KLEstimatorName,
    LossAggModeName,
    PolicyLossName,
    PresetName,
    RewardNormName,
    check_algorithm,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_expands_to_its_values(preset):
    cfg = AlgorithmConfig(preset=preset)
    for field, value in PRESETS[preset].items():
        assert getattr(cfg, field) == value, (preset, field)
    # the expansion is visible in the resolved config
    assert cfg.model_dump()["preset"] == preset


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_passes_its_own_checks(preset):
    cfg = AlgorithmConfig(preset=preset)
    assert check_algorithm(cfg, group_size=8, has_critic=preset == "ppo", max_response_len=8192) == []


def test_explicit_values_survive_the_preset():
    cfg = AlgorithmConfig.model_validate({"preset": "dapo", "clip_high": 0.3, "dynamic_sampling": False})
    assert cfg.clip_high == 0.3
    assert cfg.dynamic_sampling is False
    assert cfg.clip_low == 0.2  # from the preset
    assert cfg.overlong_shaping is True  # from the preset


def test_presets_differ_where_the_papers_do():
    assert AlgorithmConfig(preset="dr_grpo").std_scale == "none"
    assert AlgorithmConfig(preset="dr_grpo").loss_agg_mode == "seq-mean-token-sum-norm"
    assert AlgorithmConfig(preset="lite_ppo").std_scale == "batch"
    assert AlgorithmConfig(preset="gspo").policy_loss == "gspo"
    assert AlgorithmConfig(preset="ppo").adv_estimator == "gae"


def test_unknown_preset_and_unknown_key_are_errors():
    with pytest.raises(ValidationError, match="'grpo'"):
        AlgorithmConfig.model_validate({"preset": "grpo_plus"})
    with pytest.raises(ValidationError, match="clip_ratio"):
        AlgorithmConfig.model_validate({"clip_ratio": 0.2})


def test_ranges_are_enforced():
    for bad in ({"clip_low": 1.0}, {"gamma": 1.5}, {"kl_coef": -0.1}, {"dual_clip": 1.0}):
        with pytest.raises(ValidationError):
            AlgorithmConfig.model_validate(bad)


def test_gae_without_critic_is_rejected_with_the_fix():
    errors = check_algorithm(AlgorithmConfig(preset="ppo"), group_size=1, has_critic=False)
    assert len(errors) == 1
    assert "'gae' needs a critic" in errors[0] and "add a critic section" in errors[0]


def test_group_estimator_with_group_size_one_is_rejected_with_the_fix():
    errors = check_algorithm(AlgorithmConfig(adv_estimator="grpo"), group_size=1, has_critic=False)
    assert errors == [
        "algorithm.adv_estimator 'grpo' needs several samples per prompt, but rollout.group_size is 1: "
        "set rollout.group_size to 2 or more, or use adv_estimator 'reinforce_pp'"
    ]
    errors = check_algorithm(AlgorithmConfig(preset="dapo"), group_size=1, has_critic=False)
    assert any("dynamic_sampling" in e for e in errors)


def test_single_sample_estimators_accept_group_size_one():
    for preset in ("reinforce_pp", "raft_pp"):
        assert check_algorithm(AlgorithmConfig(preset=preset), group_size=1, has_critic=False) == []


def test_unused_critic_and_long_overlong_buffer_are_reported():
    errors = check_algorithm(
        AlgorithmConfig(preset="dapo"), group_size=4, has_critic=True, max_response_len=1024
    )
    assert any("does not use its values" in e for e in errors)
    assert any("overlong_buffer_len (4096) is longer than rollout.max_new_tokens (1024)" in e for e in errors)


def test_contradictions_inside_the_section_fail_at_load():
    with pytest.raises(ValidationError, match="difficulty_min"):
        AlgorithmConfig(difficulty_min=0.9, difficulty_max=0.1)
    with pytest.raises(ValidationError, match="kl_in to 'reward'"):
        AlgorithmConfig(kl_coef=0.1, kl_controller="adaptive")
    with pytest.raises(ValidationError, match="std_scale is set"):
        AlgorithmConfig(adv_estimator="rloo", std_scale="batch")
    # a value the preset filled in is not "set by the user": switching the estimator is fine
    assert AlgorithmConfig(preset="grpo", adv_estimator="rloo").adv_estimator == "rloo"


def test_config_names_are_the_registry_names():
    assert set(get_args(AdvEstimatorName)) == set(names("adv_estimator")) == set(ADV_ESTIMATOR_PARAMS)
    assert set(get_args(PolicyLossName)) == set(names("policy_loss")) == set(POLICY_LOSS_PARAMS)
    assert set(get_args(LossAggModeName)) == set(names("loss_agg_mode"))
    assert set(get_args(KLEstimatorName)) == set(names("kl_estimator"))
    assert set(get_args(RewardNormName)) == set(names("reward_norm"))
    assert set(get_args(PresetName)) == set(PRESETS)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(UnknownAlgorithmError) as info:
        lookup("adv_estimator", "grpoo")
    message = str(info.value)
    for name in get_args(AdvEstimatorName):
        assert repr(name) in message
    assert "did you mean 'grpo'" in message
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownAlgorithmError, match="'policy_loss'"):
        lookup("policy_los", "ppo_clip")


def test_import_without_ray_or_engines():
    code = (
        "import sys, reroll.algorithms; "
        "bad = [m for m in ('ray', 'vllm', 'sglang', 'megatron', 'deepspeed') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_algorithm_modules_import_only_torch_and_the_standard_library():
    # static check of every import statement; the subprocess test above checks the effect
    allowed = {"torch", "reroll", "__future__", *sys.stdlib_module_names}
    for path in (Path(__file__).resolve().parents[2] / "reroll" / "algorithms").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed, (path.name, roots)


def test_docs_list_every_name_and_preset():
    text = DOCS.read_text()
    for kind in ("adv_estimator", "policy_loss", "kl_estimator", "loss_agg_mode", "reward_norm"):
        for name in names(kind):
            assert f"`{name}`" in text, (kind, name)
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    for preset, values in PRESETS.items():
        for field, value in values.items():
            assert f"`{field}={value}`" in rows[f"`{preset}`"], (preset, field)
