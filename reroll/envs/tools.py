"""Tools an environment offers the policy, tool calls parsed from its text, and ``ToolEnv``.

A tool has a ``name``, a ``description``, ``parameters`` (a JSON schema object) and is called with
keyword arguments, returning text. Calls are parsed from the policy's output in one of two formats:

- ``hermes`` (Hermes / Qwen2.5 / Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call; results go back as ``<tool_response>...</tool_response>``.
- ``json_tags``: the same JSON object inside tags named by ``tag`` (``<{tag}>...</{tag}>``), results in
  ``<{tag}_result>...</{tag}_result>``; ``"parameters"`` is accepted for ``"arguments"``.

``ToolEnv`` wraps any environment: a turn that holds tool calls runs them and returns their results
as the observation (the inner environment does not step); any other turn goes to the inner
environment. ``max_calls`` bounds the calls of one episode.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, Literal, Protocol

from reroll.envs.base import Env
from reroll.rewards.sandbox import Limits, Sandbox, check_sandbox, run_python

ToolFormat = Literal["hermes", "json_tags"]
_JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict}


class Tool(Protocol):
    """A callable tool with a JSON schema for its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    def __call__(self, **arguments: Any) -> str: ...


@dataclass(frozen=True)
class ToolCall:
    """One parsed call, or the reason the text could not be parsed (``error``)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI-style function spec that chat templates take as ``tools=[...]``."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def parse_tool_calls(text: str, fmt: ToolFormat = "hermes", *, tag: str = "tool_call") -> list[ToolCall]:
    """Every call block in ``text``, in order; a malformed block becomes a ``ToolCall`` with ``error``."""
    if fmt not in ("hermes", "json_tags"):
        raise ValueError(f"unknown tool call format {fmt!r}: use 'hermes' or 'json_tags'")
    name = "tool_call" if fmt == "hermes" else tag
    calls = []
    for body in re.findall(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", text, flags=re.DOTALL):
        calls.append(_parse_call(body.strip(), allow_parameters=fmt == "json_tags"))
    return calls


def _parse_call(body: str, *, allow_parameters: bool) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}) if allow_parameters else {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error="the arguments are a string that is not JSON")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error="the arguments must be a JSON object")
    return ToolCall(obj["name"], args)


def format_tool_result(text: str, fmt: ToolFormat = "hermes", *, tag: str = "tool_call") -> str:
    """A tool's result as the policy sees it."""
    name = "tool_response" if fmt == "hermes" else f"{tag}_result"
    return f"<{name}>\n{text}\n</{name}>"


def run_tool_call(tools: dict[str, Tool], call: ToolCall) -> str:
    """The tool's text for ``call``; a bad call or a tool that raises gives an error text, never an exception."""
    if call.error is not None:
        return f"error: {call.error}"
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(tools))}"
    problem = _check_arguments(tool.parameters, call.arguments)
    if problem:
        return f"error: {call.name}: {problem}"
    try:
        return tool(**call.arguments)
    except Exception as e:  # the policy's input broke the tool: tell the policy
        return f"error: {call.name} failed: {type(e).__name__}: {e}"


def _check_arguments(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing argument {missing[0]!r}"
    for key, value in args.items():
        if key not in props:
            return f"unknown argument {key!r}; the arguments are {', '.join(props)}"
        want = _JSON_TYPES.get(props[key].get("type", ""))
        if want is not None and not isinstance(value, want):
            return f"argument {key!r} must be a {props[key]['type']}, got {type(value).__name__}"
    return None


class Calculator:
    """Exact arithmetic on numbers: + - * / // % ** and parentheses (no names, no calls).

    Integers stay exact: ``7 / 2`` is ``7/2`` (a fraction), not ``3.5``; a float in the input gives a float.
    """

    name = "calculator"
    description = "Evaluate an arithmetic expression exactly, e.g. '(3 + 4) * 12 / 5' gives 84/5."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "The expression."}},
        "required": ["expression"],
    }
    _OPS: ClassVar[dict[type, Callable[..., Any]]] = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
        ast.USub: operator.neg,
        ast.UAdd: operator.pos,
    }

    def __call__(self, expression: str) -> str:
        value = self.evaluate(expression)
        if isinstance(value, Fraction):
            return (
                str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
            )
        return str(value)

    def evaluate(self, expression: str) -> Fraction | float:
        return self._eval(ast.parse(expression, mode="eval").body)

    def _eval(self, node: ast.AST) -> Fraction | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(node.value) if isinstance(node.value, int) else node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._OPS:
            return self._OPS[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self._OPS:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponents above 100 are not allowed")
            return self._OPS[type(node.op)](left, right)
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


class PythonTool:
    """Run a Python program in ``reroll.rewards.sandbox`` and return what it printed.

    ``sandbox``: ``bubblewrap`` (default) or ``audit_hook`` (weaker; see the sandbox module). Made
    without a usable bubblewrap, the tool raises ``SandboxUnavailable`` at once, naming the fix,
    rather than answering every call with an error the policy would train on.
    """

    name = "python"
    description = "Run a Python program and return its standard output; print the values you need."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The program."}},
        "required": ["code"],
    }

    def __init__(
        self,
        cpu_s: int = 2,
        wall_s: float = 5.0,
        memory_mb: int = 256,
        max_chars: int = 500,
        sandbox: Sandbox = "bubblewrap",
    ):
        check_sandbox(sandbox)
        self.limits = Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, max_output_bytes=max_chars * 4)
        self.max_chars, self.sandbox = max_chars, sandbox

    def __call__(self, code: str) -> str:
        result = run_python(code, limits=self.limits, sandbox=self.sandbox)
        if result.status != "ok":
            tail = result.stderr.strip().splitlines()[-1:] or [""]
            return f"error ({result.status}): {tail[0]}"[: self.max_chars]
        return result.stdout.strip()[: self.max_chars]


class ToolEnv:
    """An environment whose policy may call ``tools`` before acting; the calls are turns of the episode."""

    def __init__(
        self,
        env: Env,
        tools: list[Tool],
        *,
        fmt: ToolFormat = "hermes",
        tag: str = "tool_call",
        max_calls: int = 4,
    ) -> None:
        self.env, self.fmt, self.tag, self.max_calls = env, fmt, tag, max_calls
        self.tools = {t.name: t for t in tools}
        self.calls = 0
        self.last_results: list[str] = []

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.calls, self.last_results = 0, []
        return self.env.reset(seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        calls = parse_tool_calls(action, self.fmt, tag=self.tag)
        if not calls:
            return self.env.step(action)
        results = []
        for call in calls:
            if self.calls >= self.max_calls:
                results.append(f"error: the limit of {self.max_calls} tool calls is reached; answer now")
                break
            self.calls += 1
            results.append(run_tool_call(self.tools, call))
        self.last_results = results
        text = "\n".join(format_tool_result(r, self.fmt, tag=self.tag) for r in results)
        return text, 0.0, False, False, {"tool_calls": len(calls)}

    def __getattr__(self, name: str) -> Any:  # sample_random_action, scripted_action, ...
        return getattr(self.env, name)
