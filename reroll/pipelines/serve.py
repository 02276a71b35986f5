"""``reroll serve``: the policy behind an OpenAI-compatible chat endpoint, until interrupted.

The endpoint (``reroll.roles.chat_server``) answers through actor_infer as a run starts it: the
configured engine (``rollout.engine``), placement (``roles.actor_infer``, ``placement``) and backend
(``runtime.backend``), with ``rollout``'s sampling settings as the defaults a request may override.
``--checkpoint`` serves a checkpoint (or a run directory's latest) instead of ``model.path``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from reroll.config.schema import RunConfig
from reroll.errors import UserError
from reroll.models.loading import load_tokenizer
from reroll.models.tiny import ensure_tiny_model
from reroll.pipelines.common import sampling, with_checkpoint
from reroll.roles.actor_infer import EngineGroup
from reroll.roles.chat_server import ChatServer
from reroll.runtime.actors import start_ray
from reroll.runtime.placement import ResourceManager

log = logging.getLogger(__name__)


def serve(
    cfg: RunConfig,
    *,
    checkpoint: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    ready: Callable[[ChatServer], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or the process is interrupted); ``ready(server)`` once it listens."""
    cfg = with_checkpoint(cfg, checkpoint)
    ensure_tiny_model(cfg.model)
    tokenizer = load_tokenizer(cfg.model.path)
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"model {cfg.model.path}: its tokenizer has no chat template, so chat requests cannot be made "
            "into prompts: serve an instruct model, or add a chat_template to its tokenizer_config.json"
        )
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
            )
        except OSError as e:
            raise UserError(
                f"cannot listen on {host}:{port} ({e.strerror}): choose another --port / --host"
            ) from e
        with server:
            if ready is not None:
                ready(server)
            stop = stop or threading.Event()
            while not stop.wait(1.0):  # a timed wait, so Ctrl-C reaches the main thread at once
                pass
    finally:
        if rollout is not None:
            rollout.shutdown()
        placement.shutdown()
