"""Strict YAML config loading: dotted overrides, every problem reported at once, resolved-config dumps.

``load_config("examples/x.yaml", RunConfig, ["rollout.group_size=16"])`` reads the file, applies the
overrides, validates into the schema and runs the schema's ``check()`` hook. Whatever is wrong comes
back as one ``ConfigError`` that lists every problem with its dotted path and a hint::

    config examples/x.yaml has 2 problems:
      rollout.grop_size: unknown key; did you mean 'group_size'?
      train.lr: expected a number, got 'fast'
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import os
import re
import tempfile
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from reroll.errors import UserError

T = TypeVar("T", bound=BaseModel)
_Override = tuple[tuple[str, ...], str]  # (key path, the override's text)

_UNIONS = (Union, types.UnionType)
_MAPPINGS = (dict, Mapping)
_SEQUENCES = (list, tuple, set, frozenset, Sequence)
_EXPECTED = {  # pydantic error type -> what the value should have been, in plain words
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "a number"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "true or false"),
    **dict.fromkeys(("list_type", "tuple_type", "set_type"), "a list"),
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type", "dataclass_type"), "a mapping"),
    "string_type": "a string",
}
_BOUNDS = {"greater_than_equal": "ge", "greater_than": "gt", "less_than_equal": "le", "less_than": "lt"}
_RANGE_WORDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "multiple_of": "a multiple of"}
_RANGE_WORDS |= {"min_length": "length >=", "max_length": "length <="}
_SHOULD = re.compile(r"^\w+ should")  # pydantic's "Input should be ..." -> "must be ..."


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config: where (``rollout.group_size``, ``data.files[0]``) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(UserError):
    """Every problem found in a config, reported together; ``str()`` is a readable report."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str = "config") -> None:
        super().__init__(list(problems), source)
        self.problems = list(problems)
        self.source = source

    def __str__(self) -> str:
        count = len(self.problems)
        header = f"{self.source} has {count} problem{'' if count == 1 else 's'}:"
        return "\n".join([header, *(f"  {problem}" for problem in self.problems)])


def load_config(
    path: str | Path,
    model: type[T],
    overrides: Sequence[str] = (),
    check: Callable[[T], Sequence[Any]] | None = None,
) -> T:
    """Read a YAML file, apply ``key.sub.key=value`` overrides, validate into ``model``, run its ``check()``.

    ``check()`` (optional) returns cross-field problems as ``ConfigProblem``s or ``(path, message)`` pairs;
    it runs once every field is valid. ``check``: another function of the config to run in its place
    (``reroll generate`` checks only what generating reads).
    """
    path, source = Path(path), f"config {path}"
    try:
        data = apply_overrides(_read_yaml(path), parse_overrides(overrides))
    except ConfigError as e:
        raise _with_quote_hints(e, _split_overrides(overrides)) from None
    model = _member(model, data, source)
    try:
        cfg = model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_problems_from(e, model, _split_overrides(overrides)), source) from None
    own = getattr(cfg, "check", None)
    found = (check(cfg) if check is not None else own() if callable(own) else []) or []
    if found:
        raise ConfigError([p if isinstance(p, ConfigProblem) else ConfigProblem(*p) for p in found], source)
    return cfg


def _member(model: type[T], data: dict[str, Any], source: str) -> type[T]:
    """The model ``data`` validates into: ``model.model_for(data)`` where ``model`` is a union of
    models told apart by a key (``RunConfig``: by ``pipeline``), else ``model``."""
    pick = getattr(model, "model_for", None)
    if pick is None:
        return model
    try:
        return pick(data)
    except ConfigError as e:
        raise ConfigError(e.problems, source) from None


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["a.b=3", "a.c=[1, 2]"]`` -> ``{"a": {"b": 3, "c": [1, 2]}}``; values are parsed as YAML."""
    nested: dict[str, Any] = {}
    for keys, item in _split_overrides(items):
        value: Any = _parse_value(item.partition("=")[2])
        for key in reversed(keys):
            value = {key: value}
        nested = apply_overrides(nested, value)
    return nested


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` into a copy of ``data``; a missing or null parent becomes a mapping."""
    merged = copy.deepcopy(dict(data))
    problems: list[ConfigProblem] = []
    _merge_into(merged, copy.deepcopy(dict(overrides)), (), problems)
    if problems:
        raise ConfigError(problems, "command-line overrides")
    return merged


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included, schema order) as YAML, atomically."""
    path = Path(path)
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"# resolved {type(cfg).__name__}: every field, defaults included\n{text}")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def config_reference(model: type[BaseModel]) -> str:
    """A Markdown reference of every field (dotted path, type, default, range, description)."""
    return "\n".join(
        [f"# `{model.__name__}` reference", "", _first_line(model.__doc__), "", *reference_tables(model)]
    )


def reference_tables(
    model: type[BaseModel], keys: Sequence[str] | None = None, level: str = "##", note: str = ""
) -> list[str]:
    """The reference's tables of ``model``, one per section (those under the top-level ``keys`` only,
    when given, without the top level's own table then), headed at ``level``, each with ``note``."""
    lines: list[str] = []
    for prefix, cls, doc in _sections(model, ""):
        if keys is not None and prefix.partition(".")[0] not in keys:
            continue
        leaves = [(n, f) for n, f in cls.model_fields.items() if not list(_nested_models(f.annotation, ""))]
        if not leaves:
            continue
        title = f"`{prefix}` ({cls.__name__})" if prefix else f"top level ({cls.__name__})"
        lines += [f"{level} {title}", ""]
        lines += [doc, ""] if doc and prefix else []
        lines += [note, ""] if note and prefix and "." not in prefix else []
        lines += ["| key | type | default | range | description |", "|---|---|---|---|---|"]
        lines += [_reference_row(_join(prefix, name), field) for name, field in leaves] + [""]
    return lines


def _reference_row(path: str, field: FieldInfo) -> str:
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    default = "required" if field.is_required() else json.dumps(to_jsonable_python(default))
    limits = [(w, getattr(m, k, None)) for m in field.metadata for k, w in _RANGE_WORDS.items()]
    limits_text = ", ".join(f"{w} {v}" for w, v in limits if v is not None)
    cells = [f"`{path}`", f"`{_type_str(field.annotation)}`", f"`{default}`", limits_text]
    cells.append(" ".join((field.description or "").split()))
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _read_yaml(path: Path) -> dict[str, Any]:
    """The file's top-level mapping; a missing file, bad YAML, duplicate keys or a non-mapping are errors."""
    source = f"config {path}"
    try:
        text = path.read_text(encoding="utf-8")
        duplicates = list(_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), ()))
        data = yaml.safe_load(text)
    except FileNotFoundError:
        raise ConfigError(
            [ConfigProblem("", f"no such file (looked for {path.resolve()})")], source
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([ConfigProblem("", f"cannot read the file: {e}")], source) from None
    except yaml.YAMLError as e:
        mark, reason = getattr(e, "problem_mark", None), getattr(e, "problem", None) or str(e)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        if (context := getattr(e, "context", None)) and (start := getattr(e, "context_mark", None)):
            reason += f" ({context} at line {start.line + 1}, column {start.column + 1})"
        raise ConfigError([ConfigProblem("", f"invalid YAML{where}: {reason}")], source) from None
    if duplicates or not isinstance(data, dict | None):
        message = (
            f"the top level must be a mapping of keys to values, got {type(data).__name__} {_show(data)}"
        )
        raise ConfigError(duplicates or [ConfigProblem("", message)], source)
    return data or {}


def _duplicate_keys(node: yaml.Node | None, path: tuple[str | int, ...]) -> Iterator[ConfigProblem]:
    """A key given twice in one mapping: PyYAML would silently keep only the last value."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, (*path, i))
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        key, line = str(key_node.value), key_node.start_mark.line + 1
        if key in first_line and key_node.tag != "tag:yaml.org,2002:merge":
            message = f"duplicate key (lines {first_line[key]} and {line}); give it once"
            yield ConfigProblem(_dotted((*path, key)), message)
        first_line.setdefault(key, line)
        yield from _duplicate_keys(value_node, (*path, key))


def _split_overrides(items: Sequence[str]) -> list[_Override]:
    """Each ``key.sub.key=value`` item as (key path, the item's text); malformed items are errors."""
    out, problems = [], []
    for item in items:
        key, eq, _ = item.partition("=")
        keys = tuple(part.strip() for part in key.split("."))
        if not eq or not all(keys):
            message = f"cannot read command-line override {item!r}: the form is key.sub.key=value"
            problems.append(ConfigProblem(key.strip(), message))
        else:
            out.append((keys, item))
    if problems:
        raise ConfigError(problems, "command-line overrides")
    return out


def _quote_hint(item: str) -> str:
    """For an override whose value YAML reads as a mapping (``{question}`` is ``{question: null}``): how
    to set the text instead."""
    key, _, text = item.partition("=")
    if not (text.lstrip().startswith("{") and isinstance(_parse_value(text), dict)):
        return ""
    return (
        f"; the value {text!r} reads as a YAML mapping: to set it as text, quote it inside the shell's "
        f"quotes: '{key}=\"{text}\"'"
    )


def _with_quote_hints(error: ConfigError, overrides: list[_Override]) -> ConfigError:
    """``error`` with ``_quote_hint`` added to the problems under a mapping-valued override."""
    problems = []
    for p in error.problems:
        hints = "".join(_quote_hint(item) for keys, item in overrides if p.path.startswith(".".join(keys)))
        problems.append(ConfigProblem(p.path, p.message + hints))
    return ConfigError(problems, error.source)


def _parse_value(text: str) -> Any:
    """The override's value as YAML (``3``, ``0.5``, ``true``, ``[1, 2]``, ``null``); else the text itself."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _merge_into(base: dict, over: Mapping, path: tuple[str, ...], problems: list[ConfigProblem]) -> None:
    for key, value in over.items():
        old = base.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            _merge_into(old, value, (*path, key), problems)
        elif isinstance(value, dict) and value and old is not None:
            child = next(iter(value))
            message = (
                f"cannot set {child!r} under {_dotted((*path, key))}, which is {_show(old)}, not a mapping"
            )
            problems.append(ConfigProblem(_dotted((*path, key, child)), message))
        else:
            base[key] = value


def _problems_from(
    error: ValidationError, model: type[BaseModel], overrides: list[_Override]
) -> list[ConfigProblem]:
    """pydantic's errors as problems at dotted paths; those under a command-line override name it."""
    problems: list[ConfigProblem] = []
    for err in error.errors(include_url=False):
        keys, parent = _resolve_loc(model, err["loc"])
        if err["type"] == "union_tag_invalid" and re.fullmatch(r"'\w+'", err["ctx"]["discriminator"]):
            keys = [*keys, err["ctx"]["discriminator"].strip("'")]
        message = _describe(err, keys, parent, model)
        notes = [
            item for parts, item in overrides if keys and parts[: len(keys)] == tuple(keys[: len(parts)])
        ]
        if notes:
            message += f" (set on the command line: {', '.join(notes)})"
            message += "".join(_quote_hint(item) for item in notes)
        if (problem := ConfigProblem(_dotted(keys), message)) not in problems:
            problems.append(problem)
    return problems


def _describe(err: Mapping[str, Any], keys: list[str | int], parent: Any, root: type[BaseModel]) -> str:
    """One pydantic error as plain words with the offending value and what was expected."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden":
        return _unknown_key(str(keys[-1]), parent, root)
    if kind == "missing":
        return "required key is missing"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_show(value)}"
    if kind in _BOUNDS:
        return f"must be {_RANGE_WORDS[_BOUNDS[kind]]} {ctx[_BOUNDS[kind]]}, got {_show(value)}"
    if kind in ("literal_error", "enum"):
        return _one_of(ctx["expected"], value)
    if kind == "union_tag_invalid":
        return _one_of(ctx["expected_tags"], ctx["tag"])
    if kind == "union_tag_not_found":
        return f"missing the {ctx['discriminator']} key that says which kind of section this is"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    if kind in ("too_short", "too_long"):
        bound = f"at least {ctx['min_length']}" if kind == "too_short" else f"at most {ctx['max_length']}"
        return f"must have {bound} items, got {ctx['actual_length']}"
    return f"{_SHOULD.sub('must', err['msg'])}, got {_show(value)}"


def _one_of(expected: str, value: Any) -> str:
    message = f"must be one of {expected}, got {_show(value)}"
    close = difflib.get_close_matches(str(value), re.findall(r"'([^']*)'", expected), n=1)
    return f"{message}; did you mean {close[0]!r}?" if close else message


def _unknown_key(key: str, parent: Any, root: type[BaseModel]) -> str:
    if not _is_model(parent):
        return "unknown key"
    foreign = getattr(root, "foreign_key", None)  # a key another member of root's union reads
    if parent is root and foreign is not None and (why := foreign(key)):
        return why
    valid = [field.alias or name for name, field in parent.model_fields.items()]
    close = difflib.get_close_matches(key, valid, n=2)
    if close:
        return f"unknown key; did you mean {' or '.join(map(repr, close))}?"
    homes = [prefix or "the top level" for prefix, cls, _ in _sections(root, "") if key in cls.model_fields]
    elsewhere = f"; {key!r} is a key of {' and '.join(homes)}, not of this section" if homes else ""
    return f"unknown key{elsewhere}; valid keys here: {', '.join(valid) or '(none)'}"


def _resolve_loc(model: type[BaseModel], loc: Sequence[str | int]) -> tuple[list[str | int], Any]:
    """Walk the schema along a pydantic ``loc``: the data keys (union-member tags dropped), and the type
    that holds the last key (the model whose sibling keys a typo is compared against)."""
    keys: list[str | int] = []
    tp: Any = model
    parent: Any = None
    for item in loc:
        tp = _unwrap(tp)
        if get_origin(tp) in _UNIONS:  # pydantic names the union member it tried; that is not a key
            tp = next((m for m in get_args(tp) if item in (_type_str(m), *_tags(m))), None)
            continue
        keys.append(item)
        parent, tp = tp, _child_type(tp, item)
    return keys, parent


def _child_type(tp: Any, item: str | int) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if _is_model(tp):
        return next((f.annotation for n, f in tp.model_fields.items() if item in (n, f.alias)), None)
    if origin in _MAPPINGS and len(args) == 2:
        return args[1]
    if origin in _SEQUENCES and args:
        return args[0]
    return None


def _tags(tp: Any) -> list[Any]:
    """The values a discriminated-union member accepts for any of its ``Literal`` fields."""
    fields = tp.model_fields.values() if _is_model(tp) else []
    return [v for f in fields if get_origin(f.annotation) is Literal for v in get_args(f.annotation)]


def _sections(model: type[BaseModel], prefix: str, seen: tuple = (), doc: str = "") -> Iterator[tuple]:
    """Every model class reachable from ``model``, with its dotted prefix and a one-line doc."""
    yield prefix, model, doc or _first_line(model.__doc__)
    for name, field in model.model_fields.items():
        for sub_prefix, cls in _nested_models(field.annotation, _join(prefix, name)):
            if cls not in (*seen, model):
                yield from _sections(cls, sub_prefix, (*seen, model), field.description or "")


def _nested_models(tp: Any, prefix: str) -> Iterator[tuple[str, type[BaseModel]]]:
    tp = _unwrap(tp)
    origin, args = get_origin(tp), get_args(tp)
    if _is_model(tp):
        yield prefix, tp
    elif origin in _UNIONS:
        for arg in args:
            yield from _nested_models(arg, prefix)
    elif origin in _MAPPINGS and len(args) == 2:
        yield from _nested_models(args[1], f"{prefix}.<name>")
    elif origin in _SEQUENCES and args:
        yield from _nested_models(args[0], f"{prefix}[i]")


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and the ``None`` of an optional; a union of several types stays a union."""
    while get_origin(tp) is Annotated or (get_origin(tp) in _UNIONS and type(None) in get_args(tp)):
        members = [a for a in get_args(tp) if a is not type(None)]
        if get_origin(tp) is not Annotated and len(members) > 1:
            return Union[tuple(members)]  # noqa: UP007  (a union built at run time)
        tp = members[0]
    return tp


def _type_str(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " | ".join(map(repr, args))
    if origin is Annotated:
        return _type_str(args[0])
    if origin in _UNIONS:
        return " | ".join(map(_type_str, args))
    if origin is not None:
        inner = ", ".join("..." if a is ... else _type_str(a) for a in args)
        return f"{getattr(origin, '__name__', origin)}[{inner}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _dotted(keys: Sequence[str | int]) -> str:
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else str(key)
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _first_line(doc: str | None) -> str:
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML, shortened."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
