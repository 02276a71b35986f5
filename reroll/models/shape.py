"""A model's shape for the memory estimate (``reroll.config.memory.Shape``), with its parameter count:
its config.json built on the meta device where ``model.path`` is a local directory, else the known family
its name contains. ``reroll plan`` and preflight's check of an engine's share read it."""

from __future__ import annotations

import json
from pathlib import Path

from reroll.config.memory import KNOWN, Shape, known_shape, token_shape
from reroll.errors import UserError


def model_shape(path: str) -> Shape:
    """The shape of ``path``: its config.json when local, else the known family its name contains."""
    config = Path(path) / "config.json"
    if config.exists():
        return _shape_from_config(json.loads(config.read_text()), Path(path))
    known = known_shape(path)
    if known is not None:
        return known
    raise UserError(
        f"plan: cannot tell the size of model.path {path!r}: it is not a local directory with a "
        f"config.json and not one of the known families ({', '.join(KNOWN)}); download the model first"
    )


def _shape_from_config(c: dict, path: Path) -> Shape:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from reroll.models.loading import parameter_counts
    from reroll.models.vision import is_vision_language

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    params, experts = parameter_counts(model)
    return token_shape(c, params=params, expert_params=experts)
