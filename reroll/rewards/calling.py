"""How a reward function is called: by position, ``fn(prompt, response, row, **args)``, or with keywords,
``fn(response=..., answer=..., **args)``, as TRL passes a dataset's columns.

The form is read off the function's parameter names (``call_form``):

- **positional** when its third parameter is ``row`` or ``sample`` (and its first is not ``response`` /
  ``completion``), or when it names no ``response`` / ``completion`` parameter at all:
  ``fn(prompt, response, row, **args)``;
- **keywords** otherwise, i.e. it names ``response`` (or ``completion``): each parameter gets what its
  name says, ``prompt`` the user message, ``response`` / ``completion`` the response, ``row`` the whole
  row, and any other name the row's field of that name; a ``**kwargs`` parameter takes every field of
  the row and ``prompt`` / ``response``. ``args`` from the config come last and win over a field of the
  same name. A row field named ``prompt``, ``response``, ``completion`` or ``row`` is not passed by
  that name (the name means what is listed here).

``bind_problem`` says why a function cannot be called in its form with the config's ``args`` and rows of
the given fields (``reroll validate``); ``KeywordReward`` makes a keyword-form function callable as
``fn(prompt, response, row)``, as every reward is called inside reroll.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import sysconfig
import traceback
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal

RESPONSE_NAMES = ("response", "completion")
ROW_NAMES = ("row", "sample")
OURS = ("prompt", *RESPONSE_NAMES, "row")  # keywords that mean what reroll passes, not row fields

CallForm = Literal["positional", "keywords"]


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called by position
        return None


def call_form(fn: Callable[..., Any]) -> CallForm:
    """Whether ``fn`` is called by position ``(prompt, response, row)`` or with keywords (module doc)."""
    sig = _signature(fn)
    if sig is None:
        return "positional"
    params = sig.parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = {p.name for p in params if p.kind is not p.VAR_KEYWORD and p.kind is not p.VAR_POSITIONAL}
    if not names & set(RESPONSE_NAMES):
        return "positional"
    row_third = len(positional) >= 3 and positional[2] in ROW_NAMES and positional[0] not in RESPONSE_NAMES
    return "positional" if row_third else "keywords"


def keyword_arguments(
    sig: inspect.Signature, prompt: str, response: str, row: Mapping[str, Any], args: Mapping[str, Any]
) -> dict[str, Any]:
    """The keywords a keyword-form reward with signature ``sig`` is called with."""
    takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    names = set(sig.parameters)
    ours = {"prompt": prompt, "response": response, "completion": response, "row": row}
    out = {k: v for k, v in row.items() if k not in OURS and (takes_all or k in names)}
    out |= {k: v for k, v in ours.items() if k in names or (takes_all and k in ("prompt", "response"))}
    return out | dict(args)


class KeywordReward:
    """A keyword-form reward (``call_form``) with its config ``args``, called as ``(prompt, response, row)``."""

    def __init__(self, fn: Callable[..., Any], args: Mapping[str, Any] | None = None) -> None:
        sig = _signature(fn)
        assert sig is not None, "a keyword-form reward has a signature"
        self.fn, self.args, self.sig = fn, dict(args or {}), sig
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> Any:
        return self.fn(**keyword_arguments(self.sig, prompt, response, row, self.args))

    def __repr__(self) -> str:
        return f"KeywordReward({self.__name__}{self.sig})"


def bind_problem(
    fn: Callable[..., Any],
    name: str,
    args: Mapping[str, Any],
    key: str = "reward",
    fields: Collection[str] | None = None,
) -> tuple[str, str] | None:
    """Why ``fn`` (set at config key ``key``) cannot be called in its form with ``args`` (and, for the
    keyword form, rows with ``fields``; ``None``: not known): ``(config key, message)``, or None when
    it binds."""
    sig = _signature(fn)
    if sig is None:
        return None
    if call_form(fn) == "keywords":
        found = _keyword_problem(sig, name, args, key, fields)
        return (f"{key}.{found[0]}", found[1]) if found else None
    try:
        sig.bind("prompt", "response", {}, **args)
        return None
    except TypeError as e:
        error = str(e)
    try:
        sig.bind("prompt", "response", {})
    except TypeError:
        return (
            f"{key}.fn",
            f"{name!r} cannot be called as fn(prompt, response, row, **args): its signature is {sig} "
            f"({error}): give it the parameters (prompt, response, row), or name them after what they "
            f"take, e.g. (response, answer, **kwargs), to get the row's fields as keywords",
        )
    return f"{key}.args", _args_problem(sig, name, args, key, error)


def _keyword_problem(
    sig: inspect.Signature, name: str, args: Mapping[str, Any], key: str, fields: Collection[str] | None
) -> tuple[str, str] | None:
    takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [k for k in args if k not in sig.parameters and not takes_all]
    if unknown:
        return "args", _args_problem(sig, name, args, key, f"unexpected keyword {unknown[0]!r}")
    given = set(OURS) | set(args) | (set(fields) - set(OURS) if fields is not None else set())
    required = [
        p
        for p in sig.parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if any(p.kind is p.POSITIONAL_ONLY for p in required):
        return (
            "fn",
            f"{name!r}{sig} names its parameters for keywords but takes some by position only (before '/'): "
            f"remove the '/'",
        )
    missing = [p.name for p in required if p.name not in given]
    if not missing or fields is None:
        return None
    close = difflib.get_close_matches(missing[0], sorted(fields), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        "fn",
        f"{name!r}{sig} takes the row's fields as keywords, but the rows have no field {missing[0]!r}"
        f"{hint}; they have {sorted(fields)}: rename the parameter, give it a default, or give it in args "
        f"(or take the whole row as a parameter named 'row')",
    )


def _args_problem(sig: inspect.Signature, name: str, args: Mapping[str, Any], key: str, error: str) -> str:
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    unknown = [k for k in args if k not in sig.parameters and not takes_any]
    hints = [
        f"{k!r} (did you mean {close[0]!r}?)"
        if (close := difflib.get_close_matches(k, sig.parameters, n=1))
        else repr(k)
        for k in unknown
    ]
    what = f"does not take {', '.join(hints)}" if hints else f"cannot take these args ({error})"
    return f"{name!r}{sig} {what}: fix {key}.args or the function"


def raised_at(error: BaseException) -> str:
    """Where ``error`` was raised in the user's code: ``my_reward.py, line 3, in reverse_reward`` (the
    innermost frame outside Python's own library, installed packages and reroll), or ''."""
    frames = traceback.extract_tb(error.__traceback__)
    library = [Path(p).resolve() for p in _LIBRARY_DIRS]
    mine = [f for f in frames if not any(Path(f.filename).resolve().is_relative_to(d) for d in library)]
    if not mine:
        return ""
    frame = mine[-1]
    path = Path(frame.filename)
    with contextlib.suppress(ValueError):
        path = path.resolve().relative_to(Path.cwd())
    return f"{path}, line {frame.lineno}, in {frame.name}"


def describe_error(error: BaseException) -> str:
    """``KeyError: 'expected' (at my_reward.py, line 3, in reverse_reward)``."""
    where = raised_at(error)
    return f"{type(error).__name__}: {error}" + (f" (at {where})" if where else "")


_LIBRARY_DIRS = (
    *{sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")},
    str(Path(__file__).resolve().parents[1]),  # reroll itself
)
