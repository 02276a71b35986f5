"""Third-party notices that say nothing about the user's run, hidden unless ``reroll --verbose``.

Hidden by default:

- DeepSpeed's "Setting accelerator to CPU": transformers' ``save_pretrained`` imports deepspeed
  (through accelerate) wherever it is installed, so every checkpoint logged it on CPU. A worker whose
  strategy is deepspeed shows it (``allow_deepspeed_notice``).
- Ray's "Token authentication is enabled for this Ray cluster" (the notice that it is *disabled*, a
  security warning, stays).
- vLLM's warnings (``VLLM_LOGGING_LEVEL=ERROR`` instead of WARNING; an exported value wins: among
  them the per-bucket weight-loading lines), "Triton ... doesn't include CPU backend" (logged before
  vLLM's logging is set up) and its checkpoint-loading bar (``vllm_load_bar``); torch's C++ warnings
  in workers, such as the NUMA binding notice (``TORCH_CPP_LOG_LEVEL=ERROR``).

Ray's colour codes around its worker-line prefix (``(RewardWorker pid=...)``) are left out where the
driver's output is not a terminal (a log file, a pipe): ``RAY_COLOR_PREFIX=0`` unless exported.

The command line calls ``configure`` in the driver; ``ray_runtime_env`` carries the choice to every
Ray worker (``REROLL_VERBOSE``) and runs ``configure_worker`` as each worker process starts.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

ENV = "REROLL_VERBOSE"


class _DropMessages(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


_DEEPSPEED = _DropMessages("Setting accelerator to CPU")
_RAY_AUTH = _DropMessages("Token authentication is enabled")
# logged while vLLM is imported, before its own logging (and VLLM_LOGGING_LEVEL) is set up
_VLLM_TRITON = _DropMessages("Triton is installed, but doesn't include CPU backend")
_FILTERS = (
    ("DeepSpeed", _DEEPSPEED),
    ("ray._private.authentication.authentication_token_setup", _RAY_AUTH),
    ("vllm.triton_utils.importing", _VLLM_TRITON),
)


def verbose() -> bool:
    """Whether this process shows the notices (``reroll --verbose``, or ``REROLL_VERBOSE=1``)."""
    return os.environ.get(ENV) == "1"


def configure(show: bool) -> None:
    """The driver's choice, recorded for the workers it starts, and applied here."""
    os.environ[ENV] = "1" if show else "0"
    if not all(_is_terminal(stream) for stream in (sys.stdout, sys.stderr)):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray prints its workers' lines with no colour codes
    configure_worker()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def configure_worker() -> None:
    """Install the filters in this process unless it is verbose (the loggers need not exist yet:
    the libraries add their handlers to the same logger objects later and keep the filters)."""
    for name, drop in _FILTERS:
        logger = logging.getLogger(name)
        if verbose():
            logger.removeFilter(drop)
        elif drop not in logger.filters:
            logger.addFilter(drop)


def allow_deepspeed_notice() -> None:
    """A process that trains with DeepSpeed shows what DeepSpeed detects."""
    logging.getLogger("DeepSpeed").removeFilter(_DEEPSPEED)


def ray_runtime_env() -> dict[str, Any]:
    """What Ray workers get: the driver's choice and the hook that applies it as each one starts."""
    env = {ENV: "1" if verbose() else "0"}
    if not verbose():
        env["TORCH_CPP_LOG_LEVEL"] = os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")
    return {"env_vars": env, "worker_process_setup_hook": f"{__name__}.configure_worker"}


def vllm_logging_level() -> str:
    """``VLLM_LOGGING_LEVEL`` for an engine: the exported value, else WARNING when verbose, else ERROR."""
    return os.environ.get("VLLM_LOGGING_LEVEL", "WARNING" if verbose() else "ERROR")


def vllm_load_bar() -> bool:
    """Whether vLLM shows its 'Loading safetensors checkpoint shards' bar."""
    return verbose()
