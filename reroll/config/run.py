"""``RunConfig``: the sections every pipeline reads, and the registry of each pipeline's own config model.

A config names its pipeline (``pipeline: rlvr``); that pipeline's model (``reroll.config.pipelines``:
``RLVRConfig``, ``SFTRunConfig``, ...) is ``RunConfig`` plus the sections the pipeline reads, and
nothing else. ``RunConfig.model_validate(data)`` and ``load_config(path, RunConfig)`` validate into the
model ``data['pipeline']`` names (a discriminated union whose members a test module can add to with
``register_pipeline_config``), so a key another pipeline reads is an error naming that pipeline
(``foreign_key``), and each pipeline's checks and derived values are methods of its own model: no
``if pipeline == ...`` outside it.

Build a config with ``RunConfig.model_validate`` (or a pipeline's model directly), not ``RunConfig(...)``.
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from reroll.config.base import StrictModel
from reroll.config.loader import ConfigError, ConfigProblem, reference_tables
from reroll.config.model import ModelConfig
from reroll.config.placement import check_placement, check_weight_sync, rollout_source_problems
from reroll.config.roles import RolesConfig
from reroll.config.rollout import RolloutConfig
from reroll.config.runtime import (
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    PlacementConfig,
    RuntimeConfig,
)
from reroll.config.startable import data_parallel_size
from reroll.config.training import OptimConfig, StrategyConfig

_MODELS: dict[str, type[RunConfig]] = {}  # pipeline name -> its config model (register_pipeline_config)
TRAINING_ONLY = ("algorithm", "optim", "critic")  # sections only training reads


def register_pipeline_config(model: type[RunConfig]) -> type[RunConfig]:
    """Make ``model`` the config of the pipeline its ``pipeline: Literal['name']`` field names (a class
    decorator; a test module may register a pipeline of its own)."""
    (name,) = model.model_fields["pipeline"].annotation.__args__  # type: ignore[union-attr]
    _MODELS[name] = model
    return model


def pipeline_names() -> list[str]:
    """The pipelines reroll ships, in registration order (one of one's own, named by its import path
    'package.module:Class', is left out of the lists and docs reroll writes, whichever are imported)."""
    return [name for name in _MODELS if ":" not in name]


def _shipped() -> dict[str, type[RunConfig]]:
    return {name: _MODELS[name] for name in pipeline_names()}


def pipeline_config(name: Any) -> type[RunConfig]:
    """The config model of pipeline ``name``: a registered one, or for 'package.module:Class' the one its
    module registers when imported (a pipeline of one's own). An unknown or missing name is a
    ``ValueError`` listing the pipelines."""
    if isinstance(name, str) and ":" in name and name not in _MODELS:
        module = name.partition(":")[0]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"{name!r}: cannot import {module!r} ({e})") from e
        if name not in _MODELS:
            raise ValueError(
                f"{name!r}: importing {module!r} registered no config model of that name "
                "(decorate one with reroll.config.run.register_pipeline_config)"
            )
    if isinstance(name, str) and name in _MODELS:
        return _MODELS[name]
    if name is None:
        raise ValueError(f"required key is missing: name the pipeline, one of {pipeline_names()}")
    close = difflib.get_close_matches(str(name), _MODELS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"must be one of {pipeline_names()}, got {name!r}{hint}")


class RunConfig(StrictModel):
    """A whole run: the sections every pipeline reads (its own model adds the ones it reads)."""

    pipeline: str = Field(description="Which pipeline runs: rlvr, sft, agentic, reward_model, dpo, distill.")
    name: str = Field("run", description="Run name.")
    output_dir: str = Field("runs/{name}", description="Run directory; '{name}' is replaced by the name.")
    seed: int = Field(0, description="Seed for data order, sampling and init.")
    total_steps: int = Field(100, ge=0, description="Training steps after the warm start.")
    model: ModelConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    roles: RolesConfig = Field(default_factory=RolesConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    # what differs between pipelines, as class attributes of each pipeline's model
    trains_on_rollouts: ClassVar[bool] = (
        False  # its batches are rollout.batch_size samples (mini-batches split them)
    )
    # why the rollout source's options (async, tail batching, ...) do not apply, where they do not
    no_rollout_source: ClassVar[str] = "it generates only for the held-out evaluation"
    bounded_rows: ClassVar[bool] = False  # a training row is a prompt and one response of <= max_new_tokens

    @model_validator(mode="wrap")
    @classmethod
    def _as_pipeline(cls, data: Any, handler: Any) -> Any:
        """``RunConfig.model_validate(data)`` validates into the model of ``data['pipeline']``."""
        if cls is RunConfig and isinstance(data, dict):
            return pipeline_config(data.get("pipeline")).model_validate(data)
        return handler(data)

    @model_validator(mode="before")
    @classmethod
    def _unset_foreign_sections(cls, data: Any) -> Any:
        """Another pipeline's section given as null is not set at all (a resolved config of an older
        version wrote every section, null where unused)."""
        if not isinstance(data, dict) or cls is RunConfig:
            return data
        return {
            k: v for k, v in data.items() if v is not None or k in cls.model_fields or not cls.foreign_key(k)
        }

    @field_validator("pipeline")
    @classmethod
    def _known(cls, name: str) -> str:
        pipeline_config(name)
        return name

    @classmethod
    def model_for(cls, data: Any) -> type[RunConfig]:
        """The model ``load_config`` validates ``data`` into: the pipeline's (a ``ConfigError`` naming
        the ``pipeline`` key when it names none)."""
        if cls is not RunConfig or not isinstance(data, dict):
            return cls
        try:
            return pipeline_config(data.get("pipeline"))
        except ValueError as e:
            raise ConfigError([ConfigProblem("pipeline", str(e))]) from None

    @classmethod
    def foreign_key(cls, key: str) -> str | None:
        """Why the top-level ``key`` is not this pipeline's: the pipelines that read it (None when none
        does)."""
        owners = [name for name, model in _shipped().items() if key in model.model_fields]
        if not owners or key in cls.model_fields:
            return None
        which = " and ".join(f"'{o}'" for o in owners)
        return (
            f"is read by pipeline{'s' if len(owners) > 1 else ''} {which}, not "
            f"{cls.model_fields['pipeline'].default!r}: remove it"
        )

    @classmethod
    def sections(cls) -> list[str]:
        """The top-level keys this pipeline reads beyond those every pipeline reads."""
        return [k for k in cls.model_fields if k not in RunConfig.model_fields]

    def section(self, name: str) -> Any:
        """The section ``name`` of this pipeline's config, or None where the pipeline reads no such
        section (or leaves it unset): for code that serves several pipelines (data checks, ``reroll
        generate``), where a section's presence is what it asks."""
        return getattr(self, name) if name in type(self).model_fields else None

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))

    @property
    def storage_url(self) -> str | None:
        """``checkpoint.storage`` with ``{name}`` replaced, as in ``output_dir``; None when unset."""
        storage = self.checkpoint.storage
        return storage.format(name=self.name) if storage else None

    def absolute_paths(self) -> RunConfig:
        """This config with the paths workers use made absolute against this process's working
        directory: the run directory (``output_dir``: checkpoints, the reference snapshot) and every
        model path (``model_paths``) where it is local. A Ray worker's working directory is its node's
        (where ``ray start`` ran), not the driver's, so a relative path would land there."""
        out = self.model_copy(update={"output_dir": str(self.run_dir.resolve())})
        for keys, path in self.model_paths().items():
            out = _with_value(out, keys, local_path(path))
        return out

    def model_paths(self) -> dict[tuple[str, ...], str]:
        """Every model path the run's workers load, by its keys (``("model", "path")``; a teacher's name
        may hold a dot): ``model.path`` and the pipeline's own (``_pipeline_model_paths``). Local
        directories or hub ids."""
        return {("model", "path"): self.model.path} | self._pipeline_model_paths()

    def _pipeline_model_paths(self) -> dict[tuple[str, ...], str]:
        """The pipeline's own model paths (a critic's, a judge's, teachers'), by their keys."""
        return {}

    @property
    def rollout_source(self) -> bool:
        """Whether the run's steps generate through the rollout source (``reroll.pipelines.rollout_source``:
        async, partial rollouts, over-sampling, tail batching)."""
        return False

    @property
    def prompts_per_step(self) -> int:
        return self.rollout.batch_size // self.rollout.group_size

    @property
    def compute_dtype(self) -> str:
        """The dtype the trainers' layers compute in: fsdp2's ``param_dtype`` where set (mixed
        precision; a set one also makes ``strategy.name: auto`` pick fsdp2), else ``model.dtype``."""
        return self.strategy.fsdp2.param_dtype or self.model.dtype

    @property
    def engine_logprobs(self) -> bool:
        """Whether actor_infer returns the sampled tokens' log-probs when it samples for training
        (``rollout.logprobs``; 'auto': where more than the mismatch/* metrics read them, which is
        every pipeline but rlvr without importance sampling)."""
        return True if self.rollout.logprobs == "auto" else self.rollout.logprobs

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads a reference policy's log-probs."""
        return False

    @property
    def policy_head(self) -> Literal["causal_lm", "reward"]:
        """What actor_train holds: a causal LM, or (pipeline reward_model) a one-score sequence classifier."""
        return "causal_lm"

    @property
    def warm_start_steps(self) -> int:
        """SFT steps before the loop (an ``sft`` section in a pipeline that reads one as a warm start)."""
        return 0

    @property
    def reads_targets(self) -> bool:
        """Whether the run learns from its rows' targets (``sft.target_template``): SFT, a warm start,
        offline distillation."""
        return self.warm_start_steps > 0

    @property
    def reward_domains(self) -> dict[str, Any]:
        """``reward.domains`` where the pipeline has rewards, else none: the rows route by them."""
        return {}

    @property
    def dynamic_sampling(self) -> bool:
        """DAPO's refills of groups with equal rewards (``algorithm.dynamic_sampling``, where there is one)."""
        return False

    def started_roles(self, *, generate_only: bool = False) -> dict[str, int]:
        """The roles a run of this config starts, each with how many groups of ``roles.<role>`` ranks it
        is (several teachers in distillation); ``generate_only``: for ``reroll generate``, which trains
        nothing. Read through ``reroll.config.placement.run_roles``, which says where they go."""
        if generate_only:
            return dict.fromkeys(["actor_infer", *self._scoring_roles()], 1)
        return dict.fromkeys(self._roles(), 1)

    def _roles(self) -> list[str]:
        """The pipeline's roles (its model overrides this)."""
        return ["actor_train"]

    def _reference_role(self) -> list[str]:
        """The reference role where the loss reads a reference policy; with LoRA there is none, since the
        reference is actor_train's own base model (adapters disabled): no second copy."""
        return ["reference"] if self.needs_reference and self.strategy.lora is None else []

    def _scoring_roles(self) -> list[str]:
        """The roles that score generations (a pipeline with a ``reward`` section overrides this)."""
        return []

    def check(self, *, trains: bool = True) -> list[ConfigProblem]:
        """Cross-section checks, all reported at once: the ones every pipeline shares, then the pipeline's.
        ``trains=False``: for a command that trains nothing (``reroll generate``), without the problems of
        the sections only training reads (``TRAINING_ONLY``: one sample per prompt is fine there)."""
        problems = self._training_checks()
        return problems if trains else [p for p in problems if p.path.split(".")[0] not in TRAINING_ONLY]

    def _training_checks(self) -> list[ConfigProblem]:
        problems = self._pipeline_problems()
        batch, group = self.rollout.batch_size, self.rollout.group_size
        if batch % group:
            problems.append(
                ConfigProblem(
                    "rollout.batch_size",
                    f"rollout.batch_size ({batch}) must be divisible by rollout.group_size ({group}): "
                    f"use {max(group, batch - batch % group)} or {batch - batch % group + group}",
                )
            )
        dp = data_parallel_size(self, "actor_train")
        per_update = self.optim.mini_batches * dp
        if self.trains_on_rollouts and batch % per_update:
            ranks = f"roles.actor_train.world_size ({self.roles.actor_train.world_size})"
            if self.strategy.context_parallel > 1:
                ranks = f"the data-parallel ranks ({ranks} / strategy.context_parallel = {dp})"
            elif self.strategy.name == "megatron" and self.strategy.megatron.context_parallel > 1:
                ranks = f"the data-parallel parts ({ranks} / strategy.megatron.context_parallel = {dp})"
            problems.append(
                ConfigProblem(
                    "optim.mini_batches",
                    f"rollout.batch_size ({batch}) must split into optim.mini_batches ({self.optim.mini_batches}) x "
                    f"{ranks} = {per_update} equal parts: change one of them",
                )
            )
        problems += [ConfigProblem(path, m) for path, m in check_placement(self)]
        problems += [ConfigProblem(p, m) for p, m in check_weight_sync(self, self.placement.device_type)]
        problems += [ConfigProblem(path, m) for path, m in rollout_source_problems(self)]
        if self.model.build_tiny is None and not loadable(self.model.path):
            problems.append(
                ConfigProblem(
                    "model.path",
                    f"{self.model.path!r} is neither an existing directory nor a hub id ('org/name'): fix the path, "
                    f"or add model.build_tiny to build a tiny model there",
                )
            )
        return problems

    def _pipeline_problems(self) -> list[ConfigProblem]:
        """The pipeline's own cross-section checks (its model overrides this)."""
        return []


def _with_value(obj: Any, keys: tuple[str, ...], value: Any) -> Any:
    """``obj`` (a config model, or a dict of them) with the value at ``keys`` replaced, copied on the way."""
    if not keys:
        return value
    head, rest = keys[0], keys[1:]
    if isinstance(obj, dict):
        return {**obj, head: _with_value(obj[head], rest, value)}
    return obj.model_copy(update={head: _with_value(getattr(obj, head), rest, value)})


def local_path(path: str) -> str:
    """``path`` made absolute where it exists here (a local model directory), else as it is (a hub id)."""
    return str(Path(path).resolve()) if Path(path).exists() else path


def loadable(path: str) -> bool:
    """Whether a model or dataset at ``path`` can be loaded: an existing path, or a hub id ('org/name')."""
    return looks_like_hub_id(path) or Path(path).exists()


def looks_like_hub_id(path: str) -> bool:
    """``org/name``: two non-empty parts, not a relative or absolute path."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "/", "~"))


def config_docs() -> str:
    """``reroll config-docs``: the keys every pipeline reads, then each pipeline's own sections, grouped
    by pipeline (a section several pipelines read is shown once, naming them)."""
    shipped = _shipped()
    lines = [
        "# `RunConfig` reference",
        "",
        "A whole run. `pipeline` picks the pipeline; its config reads the keys every pipeline reads and its "
        "own sections, and a section of another pipeline is an error naming the pipelines that read it.",
        "",
        "| pipeline | what it is | its sections |",
        "|---|---|---|",
    ]
    for name, model in shipped.items():
        doc = _doc_line(model)
        own = ", ".join(f"`{k}`" for k in model.sections()) or "(none)"
        lines.append(f"| `{name}` | {doc} | {own} |")
    lines += ["", "## Every pipeline", "", *reference_tables(RunConfig, level="###")]
    shown: set[str] = set()
    for name, model in shipped.items():
        own = [k for k in model.sections() if k not in shown]
        lines += [f"## Pipeline `{name}`", "", _doc_line(model), ""]
        for key in model.sections():
            readers = [n for n, m in shipped.items() if key in m.model_fields]
            if key in shown:
                lines += [f"- `{key}`: as under pipeline `{readers[0]}`", ""]
        for key in own:
            readers = [n for n, m in shipped.items() if key in m.model_fields]
            note = (
                f"Read by pipeline{'s' if len(readers) > 1 else ''} "
                + ", ".join(f"`{r}`" for r in readers)
                + "."
            )
            lines += reference_tables(model, [key], level="###", note=note)
            shown.add(key)
    return "\n".join(lines)


def _doc_line(model: type[RunConfig]) -> str:
    """The first line of a pipeline model's docstring, without its 'Pipeline <name>: ' lead."""
    first = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
    return first.partition(": ")[2] if first.startswith("Pipeline ") else first
