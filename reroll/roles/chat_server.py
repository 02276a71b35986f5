"""An OpenAI-compatible endpoint over actor_infer: ``reroll serve`` and the agent proxy of agentic training.

``ChatServer`` answers ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models``
with the Python standard library's HTTP server, so any OpenAI client can call it. A chat request's
messages become the prompt as the run's prompts were made (``PromptFormat.conversation``: the chat
template and system prompt, or one user message's raw text); a text completion's prompt is used as
it is. The prompts of requests that arrive together go to the engine in one ``generate`` call
(``reroll.roles.batcher``), so many concurrent clients share the engine's batch; ``stream: true`` is
answered token by token from the engine's ``stream_tokens`` as server-sent events. Tool calls are
parsed from the answer (``reroll.roles.tool_calls``); what a request asks of the engine (top
log-probs, ``response_format``, a forced ``tool_choice``, streaming) is checked against the engine's
spec (``reroll.config.engines``). The shapes of requests and answers are in ``reroll.roles.openai_api``.

For agentic training the server also serves one endpoint per episode, ``/episodes/<key>/v1``
(``open_episode``). There it keeps the episode's token sequence: the first call's messages start it,
each later call must repeat the conversation so far (the assistant turns as this server returned
them) and append messages, whose template tokens are added after the policy's own tokens
(``reroll.envs.trajectory``); the engine continues from that exact sequence, and the tokens and
log-probs it returns are recorded. The sampling settings are the run's (whatever the request asks),
so the recorded log-probs are those the trainer compares with. ``close_episode`` returns the record.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from reroll.config.engines import EngineSpec, engines_with
from reroll.data.chat import ChatTemplateError, PromptFormat, render_chat
from reroll.data.types import Completion, SamplingParams, TokenDelta
from reroll.envs.trajectory import Trajectory, TrajectoryBuilder
from reroll.roles.batcher import Batcher, Generate, StreamTokens
from reroll.roles.openai_api import (
    EPISODE_UNSUPPORTED,
    UNSUPPORTED,
    Answers,
    Job,
    RequestError,
    _messages,
    _params,
    json_schema,
    logprobs_asked,
    refuse,
)
from reroll.roles.tool_calls import ToolParser, forced_schema, function_specs, tool_format

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
    manager, or call ``close``.

    ``fmt``: how chat requests become prompts (default: the chat template where the tokenizer has one,
    else raw text). ``spec``: what the engine can do, checked against what a request asks (None: only
    what every engine does). ``stream_tokens``: the engine's token stream, for ``stream: true``.
    ``tool_parser``: the format tool calls are read in (default: the one the chat template shows).
    ``api_key``: requests must carry it as ``Authorization: Bearer <key>``."""

    def __init__(
        self,
        generate: Generate,
        tokenizer: Any,
        *,
        model_name: str,
        defaults: SamplingParams,
        host: str = "127.0.0.1",
        port: int = 0,
        fmt: PromptFormat | None = None,
        spec: EngineSpec | None = None,
        stream_tokens: StreamTokens | None = None,
        tool_parser: ToolParser | None = None,
        api_key: str | None = None,
    ) -> None:
        self.tokenizer, self.model_name, self.defaults = tokenizer, model_name, defaults
        self.fmt = fmt or PromptFormat(tokenizer)
        self.spec, self.api_key = spec, api_key
        shown = tool_format(getattr(tokenizer, "chat_template", None)) if self.fmt.chat else None
        self.tool_parser = tool_parser or shown
        self.builder: TrajectoryBuilder | None = None  # made by the first episode (serving needs none)
        self.episodes: dict[str, EpisodeRecord] = {}
        self.answers = Answers(tokenizer, model_name)
        self._streams = stream_tokens is not None
        self._batcher = Batcher(generate, stream_tokens=stream_tokens)
        self.httpd = _HTTPServer((host, port), _handler(self))
        self.host, self.port = host, self.httpd.server_address[1]
        # shutdown() waits for the loop's next poll: a short one closes a server at once
        serve = lambda: self.httpd.serve_forever(poll_interval=0.05)  # noqa: E731
        self._thread = threading.Thread(target=serve, name="chat-server", daemon=True)
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

    def describe(self) -> str:
        """One line: the endpoints and how a chat request becomes a prompt."""
        tools = f"; tool calls read as {self.tool_parser}" if self.tool_parser else ""
        return f"OpenAI chat and text completions; chat requests: {self.fmt.describe()}{tools}"

    def authorized(self, header: str | None) -> bool:
        """Whether a request's ``Authorization`` header carries the key (always, without one)."""
        if self.api_key is None:
            return True
        given = (header or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    def episode_call(self, path: str, body: dict[str, Any]) -> tuple[Job, list[list[Completion]]]:
        """A chat request to an episode endpoint, answered with the run's sampling settings."""
        where = "an episode endpoint (agent proxy): write tool calls as text and parse them in the agent"
        refuse(body, EPISODE_UNSUPPORTED, where)
        messages = _messages(body)
        if any(set(m) - {"role", "content"} for m in messages):
            raise RequestError(
                f"tool_calls, tool_call_id, name: not supported by {where}", code="unsupported_parameter"
            )
        completion = self._episode_call(path.split("/")[2], messages, body)
        job = Job(
            "chat", [completion.prompt_ids], replace(self.defaults, n=1), logprobs=bool(body.get("logprobs"))
        )
        return job, [[completion]]

    def job(self, path: str, body: dict[str, Any]) -> Job:
        """A ``/v1/chat/completions`` or ``/v1/completions`` request made ready for the engine."""
        refuse(body, UNSUPPORTED, "this endpoint")
        chat = path.endswith("/chat/completions")
        report, top = logprobs_asked(body, chat)
        if top:
            self._require("top_logprobs", "top_logprobs" if chat else "logprobs > 0", "top log-probs")
        schema = json_schema(body.get("response_format"))
        params = replace(_params(body, self.defaults), top_logprobs=top)
        job = Job("chat" if chat else "text", [], params, logprobs=report, stream=bool(body.get("stream")))
        job.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if job.stream and not self._streams:
            self._require("streams_tokens", "stream", "token streaming")
        job.prompts = self._chat_prompt(job, body) if chat else self._text_prompts(body)
        if job.forced is not None:
            if schema is not None:
                raise RequestError("response_format and a tool_choice that forces a call cannot be combined")
            schema = job.forced.schema
        if schema is not None:
            what = "response_format" if job.forced is None else f"tool_choice {body.get('tool_choice')!r}"
            self._require("guided_decoding", what, "guided decoding")
        job.params = replace(job.params, json_schema=schema)
        return job

    def _require(self, ability: str, request_field: str, what: str) -> None:
        """Refuse a request that asks the engine for what its spec says it cannot do."""
        if self.spec is not None and getattr(self.spec, ability):
            return
        able = engines_with(ability)
        engine = (
            f"this server's engine is {self.spec.name}" if self.spec else "this endpoint has no engine spec"
        )
        raise RequestError(
            f"{request_field} needs an engine with {what} ({', '.join(able)}), and {engine}: serve with "
            f"rollout.engine={able[0]}",
            code="unsupported_parameter",
        )

    def _chat_prompt(self, job: Job, body: dict[str, Any]) -> list[list[int]]:
        """A chat request's prompt ids, rendered as the run rendered its prompts; its tools set how the
        answer is read."""
        messages, tools = _messages(body), body.get("tools") or None
        choice = body.get("tool_choice")
        try:
            if tools is not None:
                tools = function_specs(tools)
                job.forced = forced_schema(tools, choice)
            text = self.fmt.conversation(messages, tools=tools)
            if tools is not None and text == self.fmt.conversation(messages):
                raise RequestError(
                    "the model's chat template does not write tools into the prompt, so the model would "
                    "never see them: serve a model whose template takes tools (Qwen2.5, Llama 3.1, ...)",
                    code="unsupported_parameter",
                )
        except (ChatTemplateError, ValueError) as e:
            raise RequestError(str(e)) from e
        if tools is not None and job.forced is None and choice != "none":
            if self.tool_parser is None:
                raise RequestError(
                    "tools: the model's chat template shows no tool-call format reroll reads (hermes's "
                    "<tool_call>, llama3's <|python_tag|>): start serve with --tool-parser hermes or llama3",
                    code="unsupported_parameter",
                )
            job.tools = self.tool_parser
        return [self.tokenizer.encode(text, add_special_tokens=False)]

    def _text_prompts(self, body: dict[str, Any]) -> list[list[int]]:
        """A text completion's prompts as they are: text (encoded without special tokens, as the engines
        encode text) or token ids, one or a list."""
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError(
                "'prompt' must be text, token ids, or a non-empty list of either", code="invalid_prompt"
            )
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(self.tokenizer.encode(p, add_special_tokens=False))
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                out.append(list(p))
            else:
                raise RequestError("each prompt must be non-empty text or token ids", code="invalid_prompt")
        return out

    def answer(self, job: Job) -> dict[str, Any]:
        """The whole answer to a job that does not stream."""
        return self.answers.response(job, self._batcher.submit_many(job.prompts, job.params))

    def stream(self, job: Job) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed job, as the engine makes its tokens."""
        return self.answers.chunks(job, self._batcher.stream(job.prompts, job.params))


def _handler(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _allowed(self) -> bool:
            if server.authorized(self.headers.get("Authorization")):
                return True
            self._error(
                RequestError("a valid API key is needed: Authorization: Bearer <key>", 401, "invalid_api_key")
            )
            return False

        def do_GET(self) -> None:
            if self.path in ("/health", "/"):
                self._json(200, {"status": "ok"})
            elif not self._allowed():
                return
            elif self.path.rstrip("/").endswith("/v1/models"):
                model = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "reroll"}
                self._json(200, {"object": "list", "data": [model]})
            else:
                self._error(RequestError(f"no such path {self.path!r}", 404))

        def do_POST(self) -> None:
            path = self.path.rstrip("/")
            episode = path.startswith("/episodes/") and path.endswith("/v1/chat/completions")
            if not (episode or path.endswith(("/v1/chat/completions", "/v1/completions"))):
                # the body is read so that the connection can carry the next request
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._error(RequestError(
                    f"no such path {self.path!r}: POST /v1/chat/completions or /v1/completions", 404))  # fmt: skip
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not self._allowed():
                    return
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                if episode:  # answered whole, then streamed if asked (the episode records the completion)
                    job, groups = server.episode_call(path, body)
                    if body.get("stream"):
                        self._stream(server.answers.chunks(job, _deltas(groups)))
                    else:
                        self._json(200, server.answers.response(job, groups))
                    return
                job = server.job(path, body)
                if job.stream:
                    self._stream(server.stream(job))
                else:
                    self._json(200, server.answer(job))
            except json.JSONDecodeError as e:
                self._error(RequestError(f"the request body is not JSON: {e}"))
            except RequestError as e:
                self._error(e)
            except Exception as e:  # the engine failed: the client sees a server error
                log.debug("request failed", exc_info=True)
                self._error(RequestError(f"{type(e).__name__}: {e}", 500, "engine_error"))

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: RequestError) -> None:
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            if e.status == 401:
                kind = "authentication_error"
            self._json(e.status, {"error": {"message": str(e), "type": kind, "param": None, "code": e.code}})

        def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
            """Server-sent events, each written as it comes. The first chunk is made before the status
            line, so a request the engine refuses at once still gets an error status."""
            first = next(chunks, None)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for chunk in [first] if first is not None else []:
                    self._event(f"data: {json.dumps(chunk)}\n\n")
                for chunk in chunks:
                    self._event(f"data: {json.dumps(chunk)}\n\n")
            except (BrokenPipeError, ConnectionResetError):
                log.debug("a streaming client went away; the rest of its answer is dropped")
                for _ in chunks:  # the engine call is shared: let it finish
                    pass
                return
            except Exception as e:  # the engine failed mid-stream: an error event, then the end
                log.debug("streamed request failed", exc_info=True)
                error = {
                    "error": {
                        "message": f"{type(e).__name__}: {e}",
                        "type": "server_error",
                        "code": "engine_error",
                    }
                }
                self._event(f"data: {json.dumps(error)}\n\n")
            self._event("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")

        def _event(self, event: str) -> None:
            data = event.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def _deltas(groups: list[list[Completion]]) -> Iterator[TokenDelta]:
    """Whole completions as one delta each (an episode's answer, streamed after it is made)."""
    for i, group in enumerate(groups):
        for j, c in enumerate(group):
            yield TokenDelta(i, j, c.response_ids, c.logprobs, c.top_logprobs, c.finish_reason)
