"""The tiny model a config's ``model.build_tiny`` section asks for, built where ``model.path`` does not
exist yet: a text model (``reroll.models.tiny``, dense or mixture-of-experts) or a vision-language one
(``reroll.models.tiny_vision``). Apart from both so that neither imports the other."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from reroll.models.tiny import build_tiny_model, resolve_alphabet

if TYPE_CHECKING:
    from reroll.config.model import ModelConfig, TinyModelConfig

log = logging.getLogger(__name__)


def build_tiny_from_config(path: str | Path, tiny: TinyModelConfig) -> Path:
    """Build the model ``tiny`` (a ``model.build_tiny`` section) describes at ``path``: its alphabet,
    sizes and seed (``vision``: a Qwen2.5-VL-architecture model, ``reroll.models.tiny_vision``); returns
    ``path``."""
    shape = {
        "alphabet": resolve_alphabet(tiny.alphabet),
        "hidden_size": tiny.hidden_size,
        "num_layers": tiny.num_layers,
        "num_heads": tiny.num_heads,
        "seed": tiny.seed,
    }
    if tiny.vision:
        from reroll.models.tiny_vision import build_tiny_vl_model  # transformers' VL classes: when asked

        return build_tiny_vl_model(path, **shape)
    return build_tiny_model(path, **shape, chat_template=tiny.chat_template, moe=tiny.moe)


def ensure_tiny_model(model: ModelConfig) -> Path | None:
    """Build the tiny model ``model.build_tiny`` asks for at ``model.path`` unless that path exists.

    The one call every pipeline makes at start; returns the path it built, or ``None`` when there was
    nothing to build (no ``build_tiny`` section, or ``model.path`` already exists).
    """
    if model.build_tiny is None or Path(model.path).exists():
        return None
    kind = "mixture-of-experts model" if model.build_tiny.moe else "model"
    log.info("building a tiny %s in %s (alphabet %r)", kind, model.path, model.build_tiny.alphabet)
    return build_tiny_from_config(model.path, model.build_tiny)
