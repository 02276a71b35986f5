"""OpenAI's request and response shapes for ``reroll.roles.chat_server``: requests in, answers out.

``_messages`` and ``_params`` read a request's messages and sampling settings; ``Job`` is a request
made ready for the engine (prompt token ids, ``SamplingParams``, what to report and how to read tool
calls); ``Answers`` turns completions into ``chat.completion`` / ``text_completion`` objects, and
token deltas into their streamed chunks. Nothing here talks to the engine.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from reroll.data.types import Completion, SamplingParams, TokenDelta
from reroll.envs.tools import ToolCall
from reroll.roles.tool_calls import Forced, ToolParser, held_from, parse_answer

MAX_TOP_LOGPROBS = 20
# vLLM's server writes a log-prob of -inf (a token guided decoding forbids) as this; JSON has no -inf
_FLOOR = -9999.0


class RequestError(Exception):
    """A request the server refuses: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages as ``{"role", "content"}`` with text content (parts of type text joined);
    an assistant message's ``tool_calls`` (their arguments as objects, as chat templates take them)
    and a tool message's ``tool_call_id`` / ``name`` are kept."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list of {role, content}", code="invalid_messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] has no 'role'", code="invalid_messages")
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be text", code="invalid_messages")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if m.get("tool_calls"):
            message["tool_calls"] = [_template_call(call, i) for call in m["tool_calls"]]
        message |= {k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)}
        out.append(message)
    return out


def _template_call(call: Any, i: int) -> dict[str, Any]:
    """An OpenAI tool call of an assistant message as chat templates read it (arguments an object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"messages[{i}].tool_calls: each needs function.name", code="invalid_messages")
    args = function.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as e:
            raise RequestError(
                f"messages[{i}].tool_calls: the arguments of {function['name']!r} are not JSON ({e.msg})",
                code="invalid_messages",
            ) from e
    return {
        "type": "function",
        "id": call.get("id"),
        "function": {"name": function["name"], "arguments": args},
    }


def _params(body: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    """The request's sampling settings over ``defaults`` (OpenAI's names; ``top_k`` as vLLM takes it)."""
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if stop else defaults.stop
    max_new = body.get("max_completion_tokens") or body.get("max_tokens") or defaults.max_new_tokens
    try:
        params = replace(
            defaults,
            n=int(body.get("n") or 1),
            temperature=float(body["temperature"])
            if body.get("temperature") is not None
            else defaults.temperature,
            top_p=float(body["top_p"]) if body.get("top_p") is not None else defaults.top_p,
            top_k=int(body["top_k"]) if body.get("top_k") is not None else defaults.top_k,
            max_new_tokens=int(max_new),
            stop=stop,
            seed=int(body["seed"]) if body.get("seed") is not None else defaults.seed,
            # the recorded trajectories carry them, and a request may ask for them (`logprobs`)
            logprobs=True,
        )
    except (TypeError, ValueError) as e:
        raise RequestError(f"a sampling setting is not a number: {e}") from e
    if params.n < 1 or params.max_new_tokens < 1 or params.temperature < 0:
        raise RequestError("n and max_tokens must be at least 1 and temperature at least 0")
    return params


# asked of this endpoint and not done: refused rather than ignored
UNSUPPORTED = ("functions", "function_call", "logit_bias", "echo", "suffix", "presence_penalty",
                "frequency_penalty")  # fmt: skip
EPISODE_UNSUPPORTED = ("tools", "tool_choice", "response_format", "top_logprobs", *UNSUPPORTED)


def logprobs_asked(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """Whether a request asks for its tokens' log-probs, and for how many top ones per token: a chat
    request's ``logprobs`` (true) and ``top_logprobs`` (k), a text request's ``logprobs`` (k, 0 too)."""
    asked = body.get("top_logprobs") if chat else body.get("logprobs")
    if asked is None or (chat and asked is False):
        return bool(body.get("logprobs")), 0
    if isinstance(asked, bool) or not isinstance(asked, int) or not 0 <= asked <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise RequestError(f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {asked!r}")
    return (bool(body.get("logprobs")) or asked > 0) if chat else True, asked


def refuse(body: dict[str, Any], names: Sequence[str], where: str) -> None:
    """A request that sets any of ``names`` is refused, naming them."""
    asked = [k for k in names if body.get(k)]
    best_of, n = body.get("best_of"), body.get("n") or 1
    if isinstance(best_of, int) and isinstance(n, int) and best_of > n:
        asked.append("best_of")
    if asked:
        raise RequestError(f"{', '.join(asked)}: not supported by {where}", code="unsupported_parameter")


def json_schema(response_format: Any) -> str | None:
    """The JSON schema (as text) that ``response_format`` asks the answer to follow; None for text."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is None or kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    schema = (response_format.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if not isinstance(schema, dict):
        raise RequestError(
            "response_format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
            f"'json_schema': {{'name': ..., 'schema': {{...}}}}}}; got {response_format!r}",
            code="invalid_response_format",
        )
    return json.dumps(schema)


@dataclass
class Job:
    """A request made ready for the engine. ``kind``: a chat completion or a text completion;
    ``logprobs``: report the tokens' log-probs; ``tools``: read tool calls in this format; ``forced``:
    the answer is a ``tool_choice`` held to a schema."""

    kind: Literal["chat", "text"]
    prompts: list[list[int]]
    params: SamplingParams
    logprobs: bool = False
    tools: ToolParser | None = None
    forced: Forced | None = None
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """An answer's content and tool calls."""
        if self.forced is not None:
            calls = self.forced.calls(text)
            return ("" if calls else text), calls
        if self.tools is not None:
            return parse_answer(text, self.tools)
        return text, []


def _tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]


class _Text:
    """A streamed response's text: its tokens decoded as a whole after every delta, handed out as far
    as ``limit`` allows (never half a character: a trailing replacement character waits)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def take(self, text: str, limit: int, *, last: bool = False) -> str:
        """The text not yet sent, up to ``limit`` (a trailing half character too where it is the last)."""
        if text.endswith("\ufffd") and not last:
            limit = min(limit, len(text.rstrip("\ufffd")))
        new = text[len(self.sent) : limit] if text.startswith(self.sent) else ""
        self.sent += new
        return new


class Answers:
    """Completions as OpenAI response objects, for one served model."""

    def __init__(self, tokenizer: Any, model_name: str) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name

    def _head(self, job: Job, chunk: bool = False) -> dict[str, Any]:
        if job.kind == "chat":
            kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl"
        else:
            kind, prefix = "text_completion", "cmpl"
        return {
            "id": f"{prefix}-{job.id}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
        }

    def _usage(self, job: Job, generated: int) -> dict[str, int]:
        prompt = sum(len(p) for p in job.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def response(self, job: Job, groups: list[list[Completion]]) -> dict[str, Any]:
        """The ``chat.completion`` or ``text_completion`` object of a job's completions."""
        choices = []
        for index, c in enumerate(c for group in groups for c in group):
            if job.kind == "text":
                logprobs = (
                    self._text_logprobs(c.response_ids, c.logprobs, c.top_logprobs, 0)
                    if job.logprobs
                    else None
                )
                choices.append(
                    {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
                )
                continue
            content, calls = job.split(c.text)
            # an answer that is only calls (whitespace around them aside) has no content
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content if content.strip() or not calls else None,
            }
            if calls:
                message["tool_calls"] = _tool_calls(calls)
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "finish_reason": "tool_calls" if calls else c.finish_reason,
                    "logprobs": {"content": self._chat_logprobs(c.response_ids, c.logprobs, c.top_logprobs)}
                    if job.logprobs
                    else None,
                }
            )
        generated = sum(len(c.response_ids) for group in groups for c in group)
        return self._head(job) | {"choices": choices, "usage": self._usage(job, generated)}

    def chunks(self, job: Job, deltas: Iterator[TokenDelta]) -> Iterator[dict[str, Any]]:
        """The streamed chunks of a job as its deltas arrive: per response its text (held back where
        it may be a tool call), its tokens' log-probs where asked, then its tool calls and finish
        reason when it ends; a usage chunk last where ``stream_options.include_usage`` asks."""
        head, n = self._head(job, chunk=True), job.params.n
        texts: dict[int, _Text] = {}
        generated = 0
        if job.kind == "chat":
            for index in range(len(job.prompts) * n):
                yield head | {"choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}  # fmt: skip
        for d in deltas:
            index = d.prompt * n + d.sample
            state = texts.setdefault(index, _Text(self.tokenizer))
            offset = len(state.sent)
            text = state.add(d.token_ids)
            generated += len(d.token_ids)
            limit = len(text)
            if job.forced is not None:  # the whole answer is the calls' JSON
                limit = 0
            elif job.tools is not None:
                limit = held_from(text, job.tools)
            new = state.take(text, limit, last=d.finish_reason is not None)
            if new or (job.logprobs and d.token_ids):
                yield head | {"choices": [self._piece(job, index, new, d, offset)]}
            if d.finish_reason is not None:
                yield from self._last(job, head, index, state, text, d.finish_reason)
        if job.include_usage:
            yield head | {"choices": [], "usage": self._usage(job, generated)}

    def _piece(self, job: Job, index: int, new: str, d: TokenDelta, offset: int) -> dict[str, Any]:
        """One chunk's choice: new text and the log-probs of the delta's tokens."""
        if job.kind == "text":
            lps = (
                self._text_logprobs(d.token_ids, d.logprobs, d.top_logprobs, offset) if job.logprobs else None
            )
            return {"index": index, "text": new, "logprobs": lps, "finish_reason": None}
        lps = (
            {"content": self._chat_logprobs(d.token_ids, d.logprobs, d.top_logprobs)}
            if job.logprobs
            else None
        )
        return {"index": index, "delta": {"content": new}, "logprobs": lps, "finish_reason": None}

    def _last(
        self, job: Job, head: dict[str, Any], index: int, state: _Text, text: str, finish: str
    ) -> Iterator[dict[str, Any]]:
        """A response's end: the content held back (less its tool calls), the calls, the finish reason."""
        if job.kind == "text":
            yield head | {
                "choices": [{"index": index, "text": "", "logprobs": None, "finish_reason": finish}]
            }
            return
        content, calls = job.split(text)
        rest = content[len(state.sent) :] if content.startswith(state.sent) else ""
        if rest:
            yield head | {"choices": [{"index": index, "delta": {"content": rest}, "logprobs": None,
                                       "finish_reason": None}]}  # fmt: skip
        if calls:
            made = [call | {"index": k} for k, call in enumerate(_tool_calls(calls))]
            yield head | {"choices": [{"index": index, "delta": {"tool_calls": made}, "logprobs": None,
                                       "finish_reason": None}]}  # fmt: skip
        yield head | {"choices": [{"index": index, "delta": {}, "logprobs": None,
                                   "finish_reason": "tool_calls" if calls else finish}]}  # fmt: skip

    def _token(self, token_id: int) -> str:
        return self.tokenizer.convert_tokens_to_string([self.tokenizer.convert_ids_to_tokens(token_id)])

    def _chat_logprobs(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
    ) -> list[dict[str, Any]]:
        """Chat completions' ``logprobs.content``: per token its text, log-prob, bytes and top ones."""
        out = []
        for k, (token_id, lp) in enumerate(zip(ids, lps)):
            text = self._token(token_id)
            top = [
                {"token": (t := self._token(i)), "logprob": max(v, _FLOOR), "bytes": list(t.encode())}
                for i, v in (tops[k] if k < len(tops) else [])
            ]
            out.append(
                {"token": text, "logprob": max(lp, _FLOOR), "bytes": list(text.encode()), "top_logprobs": top}
            )
        return out

    def _text_logprobs(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]], offset: int
    ) -> dict[str, Any]:
        """Text completions' ``logprobs``: tokens, their log-probs, the top ones as ``{token: log-prob}``
        and each token's character offset in the text."""
        tokens = [self._token(i) for i in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [max(lp, _FLOOR) for lp in lps],
            "top_logprobs": [{self._token(i): max(v, _FLOOR) for i, v in top} for top in tops]
            if tops
            else None,
            "text_offset": offsets,
        }
