"""An OpenAI-compatible chat endpoint over actor_infer: ``reroll serve`` and the agent proxy of agentic training.

``ChatServer`` answers ``POST /v1/chat/completions`` (``stream: true`` as server-sent events) and
``GET /v1/models`` with the Python standard library's HTTP server, so any OpenAI client can call it.
Every request's messages go through the tokenizer's chat template (``chat_prompt_ids``, the one place
a template is applied here); the prompts of requests that arrive together go to the engine in one
``generate`` call (``reroll.roles.batcher``), so many concurrent agents share the engine's batch.

For agentic training the server also serves one endpoint per episode, ``/episodes/<key>/v1``
(``open_episode``). There it keeps the episode's token sequence: the first call's messages start it,
each later call must repeat the conversation so far (the assistant turns as this server returned
them) and append messages, whose template tokens are added after the policy's own tokens
(``reroll.envs.trajectory``); the engine continues from that exact sequence, and the tokens and
log-probs it returns are recorded. The sampling settings are the run's (whatever the request asks),
so the recorded log-probs are those the trainer compares with. ``close_episode`` returns the record.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from reroll.data.chat import ChatTemplateError, render_chat
from reroll.data.types import Completion, SamplingParams
from reroll.envs.trajectory import Trajectory, TrajectoryBuilder
from reroll.roles.batcher import Batcher, Generate

log = logging.getLogger(__name__)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """The prompt token ids of ``messages`` with the generation prompt: the tokenizer's chat template,
    rendered as everywhere else (``reroll.data.chat.render_chat``)."""
    try:
        text = render_chat(tokenizer, messages, generation_prompt=True)
    except ChatTemplateError:
        raise ValueError(
            "the model's tokenizer has no chat template, so chat messages cannot be made into a prompt: "
            "use a model whose tokenizer_config.json has one (instruct models do)"
        ) from None
    return tokenizer.encode(text, add_special_tokens=False)


class RequestError(Exception):
    """A request the server refuses: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class EpisodeRecord:
    """One agent episode as the server saw it: the token sequence, the observation each turn acted
    on, and how the server ended it (``token_budget``, ``turn_limit``) if it did."""

    traj: Trajectory | None = None
    states: list[str] = field(default_factory=list)
    finish: str = ""
    params: SamplingParams = field(default_factory=SamplingParams)
    max_turns: int = 8
    max_tokens: int = 1024
    lock: threading.Lock = field(default_factory=threading.Lock)


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection; a listen backlog for hundreds of agents connecting at once (the
    standard library's 5 drops connections: clients see connection errors and connect timeouts)."""

    daemon_threads = True
    request_queue_size = 1024


class ChatServer:
    """The endpoint, started on ``host:port`` (port 0: a free one) in a background thread; ``url`` is
    its ``/v1`` base. ``defaults``: the sampling settings a request does not set. Use as a context
    manager, or call ``close``."""

    def __init__(
        self,
        generate: Generate,
        tokenizer: Any,
        *,
        model_name: str,
        defaults: SamplingParams,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.tokenizer, self.model_name, self.defaults = tokenizer, model_name, defaults
        self.builder: TrajectoryBuilder | None = None  # made by the first episode (serving needs none)
        self.episodes: dict[str, EpisodeRecord] = {}
        self._batcher = Batcher(generate)
        self.httpd = _HTTPServer((host, port), _handler(self))
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="chat-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def failure(self) -> BaseException | None:
        """The first engine error behind a refused request (a dead actor_infer worker, say)."""
        return self._batcher.failure

    def __enter__(self) -> ChatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._batcher.close()

    # --- episodes (agentic training) ---

    def open_episode(self, params: SamplingParams, *, max_turns: int, max_tokens: int) -> str:
        """A new episode endpoint; returns its key (its base URL is ``episode_url(key)``)."""
        if self.builder is None:
            chat_prompt_ids(self.tokenizer, [{"role": "user", "content": ""}])  # raises the no-template error
            self.builder = TrajectoryBuilder(self.tokenizer)  # raises for a template that is not append-only
        key = uuid.uuid4().hex
        self.episodes[key] = EpisodeRecord(params=params, max_turns=max_turns, max_tokens=max_tokens)
        return key

    def episode_url(self, key: str) -> str:
        return f"http://{self.host}:{self.port}/episodes/{key}/v1"

    def close_episode(self, key: str) -> EpisodeRecord:
        """The episode's record; later calls to its endpoint are refused."""
        record = self.episodes.pop(key)
        with record.lock:  # a call in flight finishes recording first
            return record

    def _episode_call(self, key: str, messages: list[dict[str, str]], body: dict[str, Any]) -> Completion:
        record = self.episodes.get(key)
        if record is None:
            raise RequestError(f"no open episode {key!r} (it ended, or timed out)", 404)
        if body.get("n", 1) != 1:
            raise RequestError("an episode endpoint generates one choice per call (n=1)")
        assert self.builder is not None
        with record.lock:
            if record.finish:
                raise RequestError(f"the episode has ended ({record.finish})", code="episode_ended")
            if record.traj is not None and record.traj.turns >= record.max_turns:
                record.finish = "turn_limit"
                raise RequestError(
                    f"the episode used its {record.max_turns} calls (agentic.max_turns)", code="episode_ended"
                )
            traj, new = self._extend(record, messages)
            params = record.params
            if len(traj.ids) + params.max_new_tokens > record.max_tokens:
                record.finish = "token_budget"
                raise RequestError(
                    f"the episode's {len(traj.ids)} tokens and {params.max_new_tokens} new ones pass "
                    f"agentic.max_episode_tokens={record.max_tokens}",
                    code="context_length_exceeded",
                )
            [completion] = self._batcher.submit(list(traj.ids), params)
            record.traj = traj
            record.states.append(next((m["content"] for m in reversed(new) if m["role"] != "assistant"), ""))
            self.builder.add_response(traj, completion.response_ids, completion.logprobs, completion.text)
            return completion

    def _extend(
        self, record: EpisodeRecord, messages: list[dict[str, str]]
    ) -> tuple[Trajectory, list[dict[str, str]]]:
        """A copy of the episode's trajectory with this call's new messages, and those messages."""
        assert self.builder is not None
        if messages and messages[-1]["role"] == "assistant":
            raise RequestError("the last message is the assistant's: end with a user, tool or system message")
        if record.traj is None:
            return self.builder.start(messages), messages
        old = record.traj.messages
        same = len(messages) > len(old) and all(
            a["role"] == b["role"]
            and (
                a["content"] == b["content"]
                or (a["role"] == "assistant" and a["content"].strip() == b["content"].strip())
            )
            for a, b in zip(messages, old)
        )
        if not same:
            raise RequestError(
                "this call does not continue the episode's conversation: send the earlier messages, with "
                "the assistant's replies as returned, and append new ones (reroll trains on one growing "
                "conversation per episode)",
                code="not_append_only",
            )
        traj = replace(
            record.traj,
            ids=list(record.traj.ids),
            policy=list(record.traj.policy),
            logprobs=list(record.traj.logprobs),
            turn=list(record.traj.turn),
            messages=[dict(m) for m in old],
        )
        new = messages[len(old) :]
        try:
            self.builder.add_messages(traj, new)
        except ValueError as e:  # a template that re-renders earlier turns: not one growing sequence
            raise RequestError(str(e), code="not_append_only") from e
        return traj, new

    # --- requests ---

    def complete(self, path: str, body: dict[str, Any]) -> tuple[list[Completion], list[int]]:
        """The completions for one chat request at ``path`` and its prompt ids."""
        messages = _messages(body)
        if path.startswith("/episodes/"):
            key = path.split("/")[2]
            completion = self._episode_call(key, messages, body)
            return [completion], completion.prompt_ids
        params = _params(body, self.defaults)
        try:
            prompt = chat_prompt_ids(self.tokenizer, messages)
        except ValueError as e:
            raise RequestError(str(e)) from e
        return self._batcher.submit(prompt, params), prompt

    def response(
        self, completions: list[Completion], prompt: list[int], body: dict[str, Any]
    ) -> dict[str, Any]:
        """The ``chat.completion`` object for the completions."""
        choices = []
        for i, c in enumerate(completions):
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c) if body.get("logprobs") else None,
            }
            choices.append(choice)
        generated = sum(len(c.response_ids) for c in completions)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": generated,
                "total_tokens": len(prompt) + generated,
            },
        }

    def _logprobs(self, c: Completion) -> dict[str, Any]:
        tokens = self.tokenizer.convert_ids_to_tokens(c.response_ids)
        texts = [self.tokenizer.convert_tokens_to_string([t]) for t in tokens]
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(texts, c.logprobs)
            ]
        }

    def chunks(self, completions: list[Completion], body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of a streamed answer: the role, the text token by
        token, the finish reason (the whole answer is generated first)."""
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model_name}  # fmt: skip
        for i, c in enumerate(completions):
            yield head | {
                "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                ]
            }
            shown = ""
            for k in range(1, len(c.response_ids) + 1):
                text = self.tokenizer.decode(c.response_ids[:k], skip_special_tokens=True)
                if text != shown and not text.endswith("\ufffd"):  # a whole character at a time
                    yield head | {
                        "choices": [
                            {"index": i, "delta": {"content": text[len(shown) :]}, "finish_reason": None}
                        ]
                    }
                    shown = text
            yield head | {"choices": [{"index": i, "delta": {}, "finish_reason": c.finish_reason}]}


_UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format", "logit_bias")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The request's messages as ``{"role", "content"}`` with text content (parts of type text joined)."""
    asked = [k for k in _UNSUPPORTED if body.get(k)] + (["top_logprobs"] if body.get("top_logprobs") else [])
    if asked:
        raise RequestError(
            f"{', '.join(asked)}: not supported by this endpoint (chat messages with text content only; "
            "parse tool calls from the text in your agent)",
            code="unsupported_parameter",
        )
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
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be text", code="invalid_messages")
        out.append({"role": m["role"], "content": content})
    return out


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


def _handler(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/v1/models"):
                model = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "reroll"}
                self._json(200, {"object": "list", "data": [model]})
            elif self.path in ("/health", "/"):
                self._json(200, {"status": "ok"})
            else:
                self._error(RequestError(f"no such path {self.path!r}", 404))

        def do_POST(self) -> None:
            if not self.path.rstrip("/").endswith("/v1/chat/completions"):
                self._error(RequestError(f"no such path {self.path!r}: POST /v1/chat/completions", 404))
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                completions, prompt = server.complete(self.path, body)
            except json.JSONDecodeError as e:
                self._error(RequestError(f"the request body is not JSON: {e}"))
                return
            except RequestError as e:
                self._error(e)
                return
            except Exception as e:  # the engine failed: the agent sees a server error
                log.debug("chat request failed", exc_info=True)
                self._error(RequestError(f"{type(e).__name__}: {e}", 500, "engine_error"))
                return
            if body.get("stream"):
                self._stream(server.chunks(completions, body))
            else:
                self._json(200, server.response(completions, prompt, body))

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: RequestError) -> None:
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            self._json(e.status, {"error": {"message": str(e), "type": kind, "param": None, "code": e.code}})

        def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in [*(f"data: {json.dumps(c)}\n\n" for c in chunks), "data: [DONE]\n\n"]:
                data = event.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")

    return Handler
