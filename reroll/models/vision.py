"""Vision-language models (the Qwen2-VL family: Qwen2-VL, Qwen2.5-VL): what trainers and engines ask.

One place knows how such a model reads images. A prompt's text holds one image placeholder per image
(``<|image_pad|>``, written by the chat template); ``VisionProcessor.encode`` runs the model's image
processor on the images (``pixel_values``, each image's patch grid ``image_grid_thw``) and expands each
placeholder to that image's token count (grid / merge_size^2); engines never sample the vision tokens
(``not_generated``: the forward would read a response's image token as an image's place). The forward
then takes
``model_inputs``: the pixels, the grids, and ``mm_token_type_ids`` (1 on image tokens), from which the
model computes its own 3D rotary positions (temporal, height, width: Qwen2.5-VL's M-RoPE) for right- or
left-padded rows alike; position ids are not passed (1D ones would be wrong on image tokens).

The image processor is loaded from the model's directory by ``AutoImageProcessor`` (the PIL one where
torchvision is not installed); vLLM uses the model's own processor with the same size limits
(``data.images``). The trainer is handed rows whose ids the engine expanded; it gets the same pixels by
running the same processor on the same images (``Rows.image_inputs``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from reroll.config.vision import VISION_MODEL_TYPES
from reroll.data.images import open_image
from reroll.data.types import ImageInputs
from reroll.errors import UserError

log = logging.getLogger(__name__)


def is_vision_language(config: Any) -> bool:
    """Whether a Hugging Face config (or a model: its ``config``) is a vision-language model's."""
    config = getattr(config, "config", config)
    return getattr(config, "vision_config", None) is not None


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's vision tower with its merger (Qwen2-VL's ``visual``), inside any wrapper; None for a
    text-only model."""
    towers = [m for name, m in model.named_modules() if name.split(".")[-1] == "visual"]
    return towers[0] if towers else None


def freeze_vision(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower (``model.train_vision: false``); returns its parameter count
    (0 for a text-only model)."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def model_inputs(model: Any, input_ids: torch.Tensor, images: ImageInputs | None) -> dict[str, Any]:
    """The forward's keyword arguments for ``images`` in rows ``input_ids``: pixels, grids and the
    image-token mask the model computes its 3D positions from (nothing where there are no images)."""
    if images is None:
        return {}
    config = getattr(model, "config", None)
    token = getattr(config, "image_token_id", None)
    if token is None:
        raise UserError(
            f"{type(model).__name__} takes no images (its config has no image_token_id): rows with images "
            f"need a vision-language model ({', '.join(VISION_MODEL_TYPES)})"
        )
    device = input_ids.device
    return {
        "pixel_values": images.pixel_values.to(device),
        "image_grid_thw": images.image_grid_thw.to(device),
        "mm_token_type_ids": (input_ids == token).int(),
    }


class VisionProcessor:
    """A model's image processor and placeholder expansion: ``encode(text, images)`` gives the prompt's
    token ids with each placeholder expanded and the images' ``ImageInputs``.

    ``min_pixels`` / ``max_pixels`` (``data.images``) override the processor's size limits."""

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(model_path)
        if not is_vision_language(config):
            raise UserError(
                f"model.path {model_path!r} is a {config.model_type!r} model, which reads no images, but the "
                f"rows have images: use a vision-language model ({', '.join(VISION_MODEL_TYPES)}), or set "
                "data.image_field to null to train on the text alone"
            )
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(
                model_path, **_size(min_pixels, max_pixels)
            )
        except OSError as e:
            raise UserError(
                f"model.path {model_path!r} has no image processor (preprocessor_config.json): {e}"
            ) from e
        self.tokenizer = tokenizer
        self.image_token_id = int(config.image_token_id)
        self.placeholder = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge = int(getattr(self.image_processor, "merge_size", 1))
        # tokens only a processor writes: a response holding one would be read as an image's place
        self.not_generated = sorted(
            {int(i) for k in _VISION_TOKEN_KEYS if (i := getattr(config, k, None)) is not None}
        )

    @classmethod
    def for_rollout(cls, model_path: str, tokenizer: Any, images: Any = None) -> VisionProcessor:
        """The processor with ``rollout.images``' size limits (an ``ImagesConfig``; None: the model's own)."""
        if images is None:
            return cls(model_path, tokenizer)
        return cls(model_path, tokenizer, min_pixels=images.min_pixels, max_pixels=images.max_pixels)

    def images(self, images: Sequence[bytes]) -> ImageInputs | None:
        """The processor's pixels and grids of encoded ``images`` (None for none)."""
        if not images:
            return None
        out = self.image_processor(images=[open_image(b) for b in images], return_tensors="pt")
        return ImageInputs(out["pixel_values"], out["image_grid_thw"].long())

    def expand(self, text: str, inputs: ImageInputs | None) -> list[int]:
        """``text``'s token ids with its k-th placeholder repeated for image k's tokens."""
        pieces = text.split(self.placeholder)
        count = 0 if inputs is None else inputs.image_grid_thw.shape[0]
        if len(pieces) - 1 != count:
            raise UserError(
                f"the prompt has {len(pieces) - 1} image placeholders ({self.placeholder!r}) for {count} "
                "images: the chat template writes one per image of the row; check data.prompt_template and "
                "the template"
            )
        if inputs is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        sizes = (inputs.image_grid_thw.prod(-1) // self.merge**2).tolist()
        expanded = pieces[0] + "".join(self.placeholder * n + piece for n, piece in zip(sizes, pieces[1:]))
        return self.tokenizer.encode(expanded, add_special_tokens=False)

    def encode(self, text: str, images: Sequence[bytes]) -> tuple[list[int], ImageInputs | None]:
        """The prompt's token ids (placeholders expanded) and its images' inputs."""
        inputs = self.images(images)
        return self.expand(text, inputs), inputs


_VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def processor_size(model_path: str, images: Any = None) -> dict[str, int]:
    """The image processor's size limits in pixels, ``{"shortest_edge", "longest_edge"}``, with
    ``rollout.images``' overrides (an ``ImagesConfig``; None: the model's own): both edges, as another copy
    of the processor (vLLM's) must be given them; one edge alone fails there ("Failed to apply
    Qwen2_5_VLProcessor ... size={'longest_edge': ...}", seen on the GPU with vLLM 0.25)."""
    from transformers import AutoImageProcessor

    over = {} if images is None else _size(images.min_pixels, images.max_pixels)
    size = AutoImageProcessor.from_pretrained(model_path, **over).size
    edges = {k: getattr(size, k, None) if not isinstance(size, dict) else size.get(k) for k in _EDGES}
    return {k: int(v) for k, v in edges.items() if v is not None}


_EDGES = ("shortest_edge", "longest_edge")


def _size(min_pixels: int | None, max_pixels: int | None) -> dict[str, Any]:
    """The image processor's ``size`` override for ``data.images.min_pixels`` / ``max_pixels``."""
    limits = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    return {k: v for k, v in limits.items() if v is not None}
