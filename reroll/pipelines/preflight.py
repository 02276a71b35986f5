"""What a run's inputs can be checked for without starting anything: ``reroll validate`` and ``run()``
(before any worker starts) call ``preflight``, and every problem comes back at once, each naming its
config key or file and the fix.

Checked:

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
  message lists, chosen different from rejected). Files ``preference.synthetic`` will write are skipped
  while they do not exist.
- rewards: every ``fn`` imports (a registered name or ``package.module:function``) and can be called as
  ``fn(prompt, response, row, **args)`` with the configured ``args`` (``inspect.signature().bind``).
- an ``agent:`` environment (``agentic.env``): the function imports and binds ``(base_url, task,
  **agentic.env_config)``; ``agentic.tasks`` / ``eval_tasks`` read as rows.
- distillation and RLHF models (``distill.teachers``, ``reward.model``) where their paths are local: a
  teacher has the student's tokenizer; a reward model is a one-label ``...ForSequenceClassification``;
  the data rows route to a teacher (their ``domain``).
- ``output_dir``: nothing on its path is a regular file, and it can be written.
- lengths: ``rollout.max_new_tokens`` and ``rollout.vllm.max_model_len`` within the model's context
  length, read from ``config.json`` where ``model.path`` is a local directory.
- what the roles would refuse when they start, decided by the config alone (``reroll.config.startable``,
  which ``reroll plan`` runs too): Megatron parallel sizes and models not built, options a strategy or
  engine does not take, an engine rank spanning pool devices; the device-dependent ones (Megatron or
  vLLM sleep mode on CPUs) where the device type is known (``placement.device_type``, or the cluster).
- the Ray cluster holds the roles (``config.placement.cluster_problems``), when this process is
  already connected to one (``ray.is_initialized()``).

Left out: ``agentic.max_episode_tokens`` against the context (RoPE models run past
``max_position_embeddings``, and the tiny game models' episodes do); rows after the first
``PEEK_ROWS`` (the run loads them all before any worker starts and reports the first bad one the
same way); context lengths of hub models not on disk; joining a Ray
cluster only to check it (``reroll validate`` starts nothing; ``train`` checks the cluster it joins,
``runtime.placement.ResourceManager``, before any worker starts); what only a call can show (a reward
that raises on its inputs: ``reward.max_error_share`` stops the run at the first such step).
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import sys
from pathlib import Path

from reroll.config.loader import ConfigError, ConfigProblem
from reroll.config.placement import cluster_problems
from reroll.config.run import loadable
from reroll.config.schema import RunConfig
from reroll.config.startable import start_problems
from reroll.config.teacher import teacher_for
from reroll.data.chat import ChatTemplateError, PromptFormat
from reroll.data.datasets import Source, check_row, read_rows, source_name, template_fields
from reroll.data.preferences import check_preference_row
from reroll.envs.agent import is_agent, load_agent
from reroll.errors import UserError
from reroll.rewards import resolve_reward
from reroll.rewards.routing import domain_required_fields, domain_terms, route, term_key

PEEK_ROWS = 100  # rows of each data file checked for their fields
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def preflight(cfg: RunConfig, source: str = "config") -> None:
    """Raise one ``ConfigError`` listing every problem ``check_inputs`` finds."""
    problems = check_inputs(cfg)
    if problems:
        raise ConfigError(problems, source)


def check_inputs(cfg: RunConfig) -> list[ConfigProblem]:
    """Every problem of the run's data files, rewards, output directory, lengths and cluster fit."""
    problems = _check_output_dir(cfg)
    problems += _check_data(cfg)
    problems += _check_preferences(cfg)
    problems += _check_chat_template(cfg)
    agentic = cfg.section("agentic")
    if cfg.section("reward") is not None:
        problems += _check_rewards(cfg)
    elif agentic is not None and is_agent(agentic.env):
        problems += _check_agent(cfg)
    problems += _check_lengths(cfg)
    problems += _check_startable(cfg)
    problems += _check_teacher_models(cfg)
    problems += _check_cluster(cfg)
    return problems


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


def _data_files(cfg: RunConfig) -> list[tuple[str, Source, list[str]]]:
    """``(config key, file, fields its rows need)`` for every data file the run reads."""
    data, sft = cfg.section("data"), cfg.section("sft")
    if data is None:
        return []
    fields = template_fields(data.prompt_template)
    needs = [*fields, *([] if cfg.reward_domains else [data.answer_field])]
    target = template_fields(sft.target_template if sft is not None else "{answer}")
    warm_start = cfg.reads_targets  # the rows' targets are learned from (SFT, a warm start, offline distill)
    sft_files = sft.files if sft is not None and sft.files else None
    train_needs = needs + (target if warm_start and sft_files is None else [])
    out = [(f"data.train_files[{i}]", f, train_needs) for i, f in enumerate(data.train_files)]
    out += [(f"data.eval_files[{i}]", f, needs) for i, f in enumerate(data.eval_files)]
    if warm_start and sft_files is not None:
        sft_needs = [*fields, data.answer_field, *target]
        out += [(f"sft.files[{i}]", f, sft_needs) for i, f in enumerate(sft_files)]
    return [(key, f, list(dict.fromkeys(n))) for key, f, n in out]


def _check_data(cfg: RunConfig) -> list[ConfigProblem]:
    problems = []
    synthetic, data = set(), cfg.section("data")
    if data is not None and data.synthetic is not None:  # paths only (RunConfig.check)
        synthetic = {str(data.train_files[0]), *map(str, data.eval_files[:1])}
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
        except UserError as e:
            problems.append(ConfigProblem(key, str(e)))
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
    for key, file in files:
        if file in synthetic and not Path(file).exists():
            continue  # preference.synthetic writes it at start
        try:
            rows = read_rows(file)
            if not rows:
                raise UserError(f"{file}: has no rows: add pairs, or remove it from {key.split('[')[0]}")
            for i, row in enumerate(rows):
                check_preference_row(file, i, row)
        except UserError as e:
            problems.append(ConfigProblem(key, str(e)))
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


def _check_rewards(cfg: RunConfig) -> list[ConfigProblem]:
    problems = []
    for domain, terms in domain_terms(cfg.reward).items():
        for i, term in enumerate(terms):
            key = term_key(cfg.reward, domain, i)
            try:
                fn = resolve_reward(term.fn)
            except UserError as e:
                problems.append(ConfigProblem(f"{key}.fn", str(e)))
                continue
            args = dict(term.args) | ({"judge": None} if term.fn == "engine_judge" else {})
            problem = _call_problem(fn, term.fn, args, key)
            if problem is not None:
                problems.append(problem)
    return problems


def _call_problem(fn: object, name: str, args: dict, key: str) -> ConfigProblem | None:
    """Whether ``fn(prompt, response, row, **args)`` binds to ``fn``'s signature."""
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return None
    try:
        sig.bind("prompt", "response", {}, **args)
        return None
    except TypeError as e:
        error = str(e)
    try:
        sig.bind("prompt", "response", {})
    except TypeError:
        return ConfigProblem(
            f"{key}.fn",
            f"{name!r} cannot be called as fn(prompt, response, row, **args): its signature is {sig} "
            f"({error}): give it the parameters (prompt, response, row)",
        )
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [k for k in args if k not in sig.parameters and not takes_any]
    hints = [
        f"{k!r} (did you mean {close[0]!r}?)"
        if (close := difflib.get_close_matches(k, sig.parameters, n=1))
        else repr(k)
        for k in unknown
    ]
    what = f"does not take {', '.join(hints)}" if hints else f"cannot take these args ({error})"
    return ConfigProblem(f"{key}.args", f"{name!r}{sig} {what}: fix {key}.args or the function")


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


def _check_startable(cfg: RunConfig) -> list[ConfigProblem]:
    """What this version would refuse while the roles start (``reroll.config.startable``, the check
    ``reroll plan`` runs too); device-dependent checks only when the device type is known."""
    return [ConfigProblem(path, m) for path, m in start_problems(cfg, _connected_device_type(cfg))]


def _check_cluster(cfg: RunConfig) -> list[ConfigProblem]:
    """The roles fit the Ray cluster this process is connected to; nothing when it is not connected."""
    ray = sys.modules.get("ray")
    if cfg.runtime.backend != "ray" or ray is None or not ray.is_initialized():
        return []
    resources, device_type = ray.cluster_resources(), _connected_device_type(cfg)
    return [ConfigProblem(path, message) for path, message in cluster_problems(cfg, resources, device_type)]
