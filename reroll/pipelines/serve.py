"""``reroll serve``: the policy behind an OpenAI-compatible endpoint, until interrupted.

The endpoint (``reroll.roles.chat_server``) answers through actor_infer as a run starts it: the
configured engine (``rollout.engine``), placement (``roles.actor_infer``, ``placement``) and backend
(``runtime.backend``), with ``rollout``'s sampling settings as the defaults a request may override.
A chat request becomes a prompt as the run made its prompts (``serve_format``: ``data.chat_template``
and ``data.system_prompt``, so a model trained on raw prompts reads one user message's raw text);
``/v1/completions`` takes raw prompts as they are. What the engine can do (token streaming, top
log-probs, guided decoding) is its spec's. ``--checkpoint`` serves a checkpoint (or a run directory's
latest) instead of ``model.path``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reroll.config.engines import engine_spec
from reroll.config.schema import RunConfig
from reroll.data.chat import ChatTemplateError, PromptFormat
from reroll.errors import UserError
from reroll.models.loading import load_tokenizer
from reroll.models.tiny_build import ensure_tiny_model
from reroll.pipelines.common import prompt_format, sampling, with_checkpoint
from reroll.roles.actor_infer import EngineGroup
from reroll.roles.chat_server import ChatServer
from reroll.roles.tool_calls import ToolParser
from reroll.runtime.actors import start_ray
from reroll.runtime.placement import ResourceManager

log = logging.getLogger(__name__)


def serve_format(cfg: RunConfig, tokenizer: Any) -> PromptFormat:
    """How the run made its prompts, for chat requests: ``data.chat_template`` / ``data.system_prompt``
    (``prompt_format``, as training, evaluation and ``reroll generate`` read them); a pipeline without a
    data section (agentic) plays chats: the chat template, with ``agentic.system_prompt`` where set."""
    if cfg.section("data") is not None:
        return prompt_format(cfg, tokenizer)
    agentic = cfg.section("agentic")
    try:
        return PromptFormat(
            tokenizer, chat_template=True, system_prompt=getattr(agentic, "system_prompt", None)
        )
    except ChatTemplateError as e:
        raise UserError(f"{cfg.model.path}: {e}") from e


def serve(
    cfg: RunConfig,
    *,
    checkpoint: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    tool_parser: ToolParser | None = None,
    api_key: str | None = None,
    ready: Callable[[ChatServer], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or the process is interrupted); ``ready(server)`` once it listens.
    ``tool_parser``: the format tool calls are read in (default: the one the chat template shows);
    ``api_key``: the key requests must carry."""
    cfg = with_checkpoint(cfg, checkpoint)
    ensure_tiny_model(cfg.model)
    tokenizer = load_tokenizer(cfg.model.path)
    fmt = serve_format(cfg, tokenizer)
    spec = engine_spec(cfg.rollout.engine)
    if cfg.runtime.backend == "ray":
        start_ray(cfg.runtime.ray_address)
    placement = ResourceManager(cfg)
    rollout = None
    try:
        rollout = EngineGroup(placement.cfg)
        rollout.metrics()  # returns once every rank has built its engine: the first request does not wait
        try:
            server = ChatServer(
                rollout.generate,
                tokenizer,
                model_name=cfg.name,
                defaults=sampling(cfg, n=1),
                host=host,
                port=port,
                fmt=fmt,
                spec=spec,
                stream_tokens=rollout.stream_tokens if spec.streams_tokens else None,
                tool_parser=tool_parser,
                api_key=api_key,
            )
        except OSError as e:
            raise UserError(
                f"cannot listen on {host}:{port} ({e.strerror}): choose another --port / --host"
            ) from e
        with server:
            log.info("serving %s: %s", cfg.model.path, server.describe())
            if ready is not None:
                ready(server)
            stop = stop or threading.Event()
            while not stop.wait(1.0):  # a timed wait, so Ctrl-C reaches the main thread at once
                pass
    finally:
        if rollout is not None:
            rollout.shutdown()
        placement.shutdown()
