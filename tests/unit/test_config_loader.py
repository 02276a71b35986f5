"""The strict config loader: every problem at once, each with its dotted path and a hint."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Field, model_validator

from reroll.config.base import StrictModel
from reroll.config.loader import (
    ConfigError,
    ConfigProblem,
    apply_overrides,
    config_reference,
    dump_config,
    load_config,
    parse_overrides,
)

# --- a small schema shaped like the real one ----------------------------------------------


class RolloutConfig(StrictModel):
    """How responses are sampled."""

    group_size: int = Field(8, ge=1, description="Responses sampled per prompt.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")


class AlgorithmConfig(StrictModel):
    adv_estimator: Literal["grpo", "rloo", "reinforce"] = Field("grpo", description="Advantage estimator.")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty weight.")


class TrainConfig(StrictModel):
    lr: float = Field(1e-6, gt=0.0, description="Learning rate.")
    steps: int = Field(10, ge=1, description="Optimizer steps.")
    bf16: bool = Field(True, description="Train in bfloat16.")


class RoleConfig(StrictModel):
    world_size: int = Field(1, ge=1, description="GPUs for this role.")
    device: Literal["cpu", "cuda"] = Field("cuda", description="Device kind.")

    @model_validator(mode="after")
    def _cpu_is_single(self) -> RoleConfig:
        if self.device == "cpu" and self.world_size != 1:
            raise ValueError(f"a cpu role runs on one process; got world_size={self.world_size}")
        return self


class DataConfig(StrictModel):
    train_files: list[str] = Field(description="Training data files.")
    max_prompt_len: int | None = Field(None, ge=1, description="Drop longer prompts; null keeps all.")


class FsdpConfig(StrictModel):
    kind: Literal["fsdp"] = "fsdp"
    shard: bool = True


class DeepSpeedConfig(StrictModel):
    kind: Literal["deepspeed"] = "deepspeed"
    zero_stage: int = Field(2, ge=0, le=3)


class RunConfig(StrictModel):
    """A whole run."""

    name: str = Field("run", description="Run name.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig
    roles: dict[str, RoleConfig] = Field(default_factory=dict, description="Roles by name.")
    strategy: Annotated[FsdpConfig | DeepSpeedConfig, Field(discriminator="kind")] = Field(
        default_factory=FsdpConfig
    )

    def check(self) -> list[ConfigProblem | tuple[str, str]]:
        problems: list[ConfigProblem | tuple[str, str]] = []
        if self.train.steps % self.rollout.group_size:
            problems.append(
                (
                    "train.steps",
                    f"train.steps ({self.train.steps}) must be divisible by "
                    f"rollout.group_size ({self.rollout.group_size})",
                )
            )
        if "actor" not in self.roles and self.roles:
            problems.append(ConfigProblem("roles", "an 'actor' role is required when roles are given"))
        return problems


VALID = """\
name: demo
rollout:
  group_size: 4
  stop: ["</answer>"]
algorithm:
  adv_estimator: rloo
train:
  lr: 1.0e-5
  steps: 8
data:
  train_files: [a.parquet, b.parquet]
roles:
  actor:
    world_size: 2
strategy:
  kind: deepspeed
  zero_stage: 3
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def problems_of(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), RunConfig, overrides)
    return {p.path: p.message for p in info.value.problems}


MINIMAL = "data:\n  train_files: [a.parquet]\n"

# --- loading ---------------------------------------------------------------------------------


def test_valid_config_loads_with_defaults_filled(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, VALID), RunConfig)
    assert cfg.rollout.group_size == 4
    assert cfg.rollout.temperature == 1.0  # default
    assert cfg.rollout.stop == ["</answer>"]
    assert cfg.algorithm.adv_estimator == "rloo"
    assert cfg.train.lr == 1e-5
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.roles["actor"].world_size == 2
    assert isinstance(cfg.strategy, DeepSpeedConfig) and cfg.strategy.zero_stage == 3


def test_unknown_key_at_depth_two_suggests_the_close_key(tmp_path: Path) -> None:
    text = MINIMAL + "rollout:\n  grop_size: 4\n"
    assert problems_of(tmp_path, text) == {"rollout.grop_size": "unknown key; did you mean 'group_size'?"}


def test_unknown_key_inside_a_dict_of_sections_suggests_the_close_key(tmp_path: Path) -> None:
    text = MINIMAL + "roles:\n  actor:\n    wrld_size: 2\n"
    assert problems_of(tmp_path, text) == {"roles.actor.wrld_size": "unknown key; did you mean 'world_size'?"}


def test_unknown_key_with_nothing_close_lists_the_valid_keys(tmp_path: Path) -> None:
    text = MINIMAL + "rollout:\n  beam_width: 3\n"
    assert problems_of(tmp_path, text) == {
        "rollout.beam_width": "unknown key; valid keys here: group_size, temperature, stop"
    }


def test_unknown_key_that_belongs_to_another_section_says_where(tmp_path: Path) -> None:
    text = MINIMAL + "rollout:\n  lr: 0.1\n"
    assert problems_of(tmp_path, text) == {
        "rollout.lr": "unknown key; 'lr' is a key of train, not of this section; "
        "valid keys here: group_size, temperature, stop"
    }


def test_unknown_key_inside_a_discriminated_union_member(tmp_path: Path) -> None:
    text = MINIMAL + "strategy:\n  kind: deepspeed\n  zero_stag: 1\n"
    assert problems_of(tmp_path, text) == {"strategy.zero_stag": "unknown key; did you mean 'zero_stage'?"}


def test_wrong_types_name_the_expected_type_and_the_value(tmp_path: Path) -> None:
    text = "data:\n  train_files: a.parquet\ntrain:\n  lr: fast\n  steps: 2.5\n  bf16: maybe\n"
    assert problems_of(tmp_path, text) == {
        "train.lr": "expected a number, got 'fast'",
        "train.steps": "expected an integer, got 2.5",
        "train.bf16": "expected true or false, got 'maybe'",
        "data.train_files": "expected a list, got 'a.parquet'",
    }


def test_wrong_type_inside_a_list_has_an_indexed_path(tmp_path: Path) -> None:
    text = "data:\n  train_files: [a.parquet, [b]]\n"
    assert problems_of(tmp_path, text) == {"data.train_files[1]": "expected a string, got ['b']"}


def test_out_of_range_gives_the_bound_and_the_value(tmp_path: Path) -> None:
    text = (
        MINIMAL
        + "rollout:\n  group_size: 0\ntrain:\n  lr: 0\nstrategy:\n  kind: deepspeed\n  zero_stage: 4\n"
    )
    assert problems_of(tmp_path, text) == {
        "rollout.group_size": "must be >= 1, got 0",
        "train.lr": "must be > 0.0, got 0",
        "strategy.zero_stage": "must be <= 3, got 4",
    }


def test_literal_choice_lists_the_choices_and_suggests(tmp_path: Path) -> None:
    text = MINIMAL + "algorithm:\n  adv_estimator: grop\n"
    assert problems_of(tmp_path, text) == {
        "algorithm.adv_estimator": "must be one of 'grpo', 'rloo' or 'reinforce', got 'grop'; did you mean 'grpo'?"
    }


def test_bad_discriminator_points_at_the_kind_key(tmp_path: Path) -> None:
    text = MINIMAL + "strategy:\n  kind: deepspeeed\n"
    assert problems_of(tmp_path, text) == {
        "strategy.kind": "must be one of 'fsdp', 'deepspeed', got 'deepspeeed'; did you mean 'deepspeed'?"
    }


def test_missing_required_key_and_section_validator(tmp_path: Path) -> None:
    text = "data: {}\nroles:\n  actor:\n    device: cpu\n    world_size: 4\n"
    assert problems_of(tmp_path, text) == {
        "data.train_files": "required key is missing",
        "roles.actor": "a cpu role runs on one process; got world_size=4",
    }


def test_all_problems_are_reported_together_in_one_readable_error(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "rollout:\n  grop_size: 4\n  temperature: -1\ntrain:\n  lr: fast\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, RunConfig)
    assert str(info.value) == (
        f"config {path} has 3 problems:\n"
        "  rollout.temperature: must be >= 0.0, got -1\n"
        "  rollout.grop_size: unknown key; did you mean 'group_size'?\n"
        "  train.lr: expected a number, got 'fast'"
    )


def test_config_error_survives_pickling() -> None:
    error = ConfigError([ConfigProblem("a.b", "bad")], "config x.yaml")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.problems == error.problems and str(copy) == "config x.yaml has 1 problem:\n  a.b: bad"


# --- file-level errors -----------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, RunConfig)
    assert str(info.value) == f"config {path} has 1 problem:\n  no such file (looked for {path.resolve()})"


def test_yaml_syntax_error_gives_line_and_column(tmp_path: Path) -> None:
    assert problems_of(tmp_path, "rollout:\n  group_size: 4\n  temperature: [1.0\n") == {
        "": "invalid YAML at line 4, column 1: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence at line 3, column 16)"
    }


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    assert problems_of(tmp_path, "- a\n- b\n") == {
        "": "the top level must be a mapping of keys to values, got list ['a', 'b']"
    }


def test_duplicate_keys_are_errors_not_silently_dropped(tmp_path: Path) -> None:
    text = MINIMAL + "rollout:\n  group_size: 4\n  group_size: 5\n"
    assert problems_of(tmp_path, text) == {
        "rollout.group_size": "duplicate key (lines 4 and 5); give it once"
    }


# --- overrides -------------------------------------------------------------------------------


def test_overrides_parse_values_as_yaml() -> None:
    items = ["a.int=3", "a.float=0.5", "a.bool=true", "a.list=[1,2]", "a.none=null", "a.str=hello", "b="]
    expected = {"a": {"int": 3, "float": 0.5, "bool": True, "list": [1, 2], "none": None, "str": "hello"}}
    assert parse_overrides(items) == {**expected, "b": ""}


def test_overrides_apply_to_the_loaded_file(tmp_path: Path) -> None:
    overrides = [
        "rollout.group_size=2",
        "rollout.temperature=0.7",
        "train.bf16=false",
        "data.train_files=[c.parquet]",
        "name=second",
        "roles.ref.world_size=1",  # creates the section
    ]
    cfg = load_config(write(tmp_path, VALID), RunConfig, overrides)
    assert (cfg.rollout.group_size, cfg.rollout.temperature, cfg.train.bf16) == (2, 0.7, False)
    assert cfg.rollout.stop == ["</answer>"]  # siblings of an overridden key are kept
    assert cfg.data.train_files == ["c.parquet"] and cfg.name == "second"
    assert cfg.roles["ref"].world_size == 1 and cfg.roles["actor"].world_size == 2


def test_override_without_equals_says_the_form(tmp_path: Path) -> None:
    assert problems_of(tmp_path, MINIMAL, ("rollout.group_size", "=3")) == {
        "rollout.group_size": "cannot read command-line override 'rollout.group_size': the form is key.sub.key=value",
        "": "cannot read command-line override '=3': the form is key.sub.key=value",
    }


def test_override_under_a_value_that_is_not_a_mapping(tmp_path: Path) -> None:
    assert problems_of(tmp_path, VALID, ("rollout.group_size.x=1",)) == {
        "rollout.group_size.x": "cannot set 'x' under rollout.group_size, which is 4, not a mapping"
    }


def test_override_typo_gets_did_you_mean_and_names_the_command_line(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, MINIMAL, ("rollout.grop_size=4", "train.lr=fast"))
    assert problems == {
        "rollout.grop_size": "unknown key; did you mean 'group_size'? "
        "(set on the command line: rollout.grop_size=4)",
        "train.lr": "expected a number, got 'fast' (set on the command line: train.lr=fast)",
    }


def test_apply_overrides_deep_merges_without_mutating() -> None:
    data = {"a": {"b": 1, "c": [1]}, "d": None}
    merged = apply_overrides(data, {"a": {"b": 2}, "d": {"e": 3}})
    assert merged == {"a": {"b": 2, "c": [1]}, "d": {"e": 3}}
    assert data == {"a": {"b": 1, "c": [1]}, "d": None}
    merged["a"]["c"].append(2)
    assert data["a"]["c"] == [1]


# --- check() hook, dump, reference -------------------------------------------------------------


def test_check_hook_problems_are_raised_together(tmp_path: Path) -> None:
    text = MINIMAL + "rollout:\n  group_size: 3\ntrain:\n  steps: 8\nroles:\n  ref: {}\n"
    assert problems_of(tmp_path, text) == {
        "train.steps": "train.steps (8) must be divisible by rollout.group_size (3)",
        "roles": "an 'actor' role is required when roles are given",
    }


def test_dump_then_load_gives_the_same_config(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, VALID), RunConfig, ["train.lr=3e-7"])
    out = tmp_path / "run_dir" / "resolved.yaml"
    dump_config(cfg, out)
    assert load_config(out, RunConfig) == cfg
    text = out.read_text()
    assert "temperature: 1.0" in text  # defaults are written too
    assert text.index("rollout:") < text.index("algorithm:") < text.index("train:")  # schema order
    assert [p.name for p in out.parent.iterdir()] == ["resolved.yaml"]  # no temp file left behind


def test_reference_lists_every_field_with_type_default_range_and_doc() -> None:
    text = config_reference(RunConfig)
    assert "| `rollout.group_size` | `int` | `8` | >= 1 | Responses sampled per prompt. |" in text
    assert "| `algorithm.adv_estimator` | `'grpo' \\| 'rloo' \\| 'reinforce'` | `\"grpo\"` |" in text
    assert "| `data.train_files` | `list[str]` | `required` |  | Training data files. |" in text
    assert "| `roles.<name>.world_size` | `int` | `1` | >= 1 | GPUs for this role. |" in text
    assert "| `strategy.zero_stage` | `int` | `2` | >= 0, <= 3 |  |" in text
    assert "## `roles.<name>` (RoleConfig)\n\nRoles by name.\n" in text
    assert text.startswith("# `RunConfig` reference\n\nA whole run.\n\n## top level (RunConfig)\n\n| key |")
