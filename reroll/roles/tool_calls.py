"""Tool calls in ``reroll serve``'s answers: the formats models write them in, and ``tool_choice``.

A chat request's ``tools`` go into the prompt through the model's chat template; what the model writes
back is parsed into OpenAI ``tool_calls`` by the format its template teaches:

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the text (``reroll.envs.tools.parse_tool_calls``, which the agentic tool
  environments use too); the text outside them is the message's content.
- ``llama3`` (Llama 3.1 and later, JSON tool calling): the whole answer is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` (``;`` between them; ``arguments`` is taken too).

``tool_format`` picks the format from the chat template (``<tool_call>`` -> hermes, ``<|python_tag|>``
-> llama3) unless ``reroll serve --tool-parser`` names it. ``tool_choice: "required"`` or a named
function cannot be left to the model: the answer is held to a JSON schema by the engine's guided
decoding (``forced_schema``: a list of calls, or the named function's arguments), as vLLM's server does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from reroll.envs.tools import ToolCall, parse_tool_calls

ToolParser = Literal["hermes", "llama3"]
TOOL_PARSERS: tuple[ToolParser, ...] = ("hermes", "llama3")
_HERMES_OPEN = "<tool_call>"


def tool_format(chat_template: str | None) -> ToolParser | None:
    """The tool-call format a chat template teaches, or ``None`` where it shows none reroll parses."""
    template = chat_template or ""
    if _HERMES_OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template:
        return "llama3"
    return None


def parse_answer(text: str, fmt: ToolParser) -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of an answer in format ``fmt``. The content is the text outside
    the calls as it is (a stream has sent the text before the first call already). An answer with a
    call that does not parse is all content, no calls: the client sees what the model wrote."""
    if fmt == "hermes":
        calls = parse_tool_calls(text, "hermes")
        content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL)
    else:
        calls, content = _llama3_calls(text), ""
    if not calls or any(c.error for c in calls):
        return text, []
    return content, calls


def _llama3_calls(text: str) -> list[ToolCall]:
    """The JSON objects that make up the whole answer, as calls (none where anything else is there)."""
    decoder, pos, calls = json.JSONDecoder(), 0, []
    body = text.strip()
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return []
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(
            args, dict
        ):
            return []
        calls.append(ToolCall(obj["name"], args))
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls


def held_from(text: str, fmt: ToolParser) -> int:
    """Where a streamed answer may have begun a tool call: its text from there is held back until the
    answer ends (and parsed then), the text before it streamed as content."""
    if fmt == "llama3":  # a call is the whole answer: hold it while it could be one
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith("{") else len(text)
    start = text.find(_HERMES_OPEN)
    if start >= 0:
        return start
    for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):  # a tag cut between two tokens
        if _HERMES_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


@dataclass(frozen=True)
class Forced:
    """A ``tool_choice`` the model must follow: its answer is JSON under ``schema``; ``name`` is the
    named function whose arguments it is (None: a list of ``{"name", "parameters"}`` calls)."""

    schema: str
    name: str | None = None

    def calls(self, text: str) -> list[ToolCall]:
        """The calls the guided answer holds (none if it was cut before the JSON closed)."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return []
        if self.name is not None:
            return [ToolCall(self.name, obj)] if isinstance(obj, dict) else []
        return [ToolCall(c["name"], c["parameters"]) for c in obj] if isinstance(obj, list) else []


def function_specs(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` checked: ``[{"type": "function", "function": {"name", ...}}]``."""
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise ValueError(
            'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}'
        )
    return tools


def forced_schema(tools: Sequence[dict[str, Any]], tool_choice: Any) -> Forced | None:
    """The JSON schema a ``tool_choice`` of ``"required"`` or ``{"type": "function", "function":
    {"name": ...}}`` holds the answer to; ``None`` for ``"auto"`` and ``"none"``."""
    if tool_choice in (None, "auto", "none"):
        return None
    specs = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if tool_choice == "required":
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
            for name, params in specs.items()
        ]
        return Forced(json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": one_of}}))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in specs:
        raise ValueError(
            f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
            f'{{"name": ...}}}} naming one of the tools ({", ".join(specs)}); got {tool_choice!r}'
        )
    return Forced(json.dumps(specs[name]), name)
