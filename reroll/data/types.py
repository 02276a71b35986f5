"""Typed records passed between roles.

``Sample``     one dataset row made into a prompt (driver -> actor_infer), with its images if any.
``ImagePrompt`` a prompt's text and images, as an engine takes a prompt with images.
``Rollout``    one generated response with the engine's token ids and log-probs (actor_infer -> driver).
``TrainBatch`` the padded tensors the trainer, the reference and the critic consume (driver -> actor_train).

Tensor layout (one convention everywhere): every ``(B, T)`` tensor is aligned with ``input_ids``, which
holds prompt then response, right-padded. ``logprobs[b, t]`` is the log-probability of token ``t`` given
the tokens before it; ``response_mask[b, t]`` is True on response tokens (the ones whose loss counts).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

import torch


def field_values(record: Any) -> dict[str, Any]:
    """A dataclass record's fields as a dict of the values themselves, not copies: what a checkpoint
    saves and ``Completion(**d)`` / ``Sample(**d)`` read back. ``dataclasses.asdict`` rebuilds every list
    of token ids on the way, about 0.1 s for a step's 256 responses of 256 tokens; a snapshot copies the
    whole state once anyway (``Pipeline.snapshot``)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


@dataclass(frozen=True)
class Sample:
    """A dataset row rendered into a prompt. ``row`` keeps every field for the reward function.

        ``message`` is the row through ``data.prompt_template`` (the user message); ``prompt`` is what the
        model reads: that message in the chat template when one is used, else the message itself
        (``message=None``: the same as ``prompt``). ``images``: the row's images, encoded (PNG, JPEG, ...
    bytes), in the order the prompt places them (one image placeholder each: ``PromptFormat.prompt``); the
    row keeps its other fields."""

    uid: str
    prompt: str
    row: dict[str, Any]
    domain: str = "default"
    message: str | None = None
    images: tuple[bytes, ...] = ()

    @property
    def text(self) -> str:
        """The user message: ``message``, or ``prompt`` where no template wrapped it."""
        return self.message if self.message is not None else self.prompt

    @property
    def engine_prompt(self) -> str | ImagePrompt:
        """What an engine takes for this sample: the prompt text, or with images an ``ImagePrompt``."""
        return ImagePrompt(self.prompt, self.images) if self.images else self.prompt


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images: ``text`` holds one image placeholder per image (the chat template's, e.g.
    Qwen2.5-VL's ``<|image_pad|>``, not yet expanded to the image's token count) and ``images`` their
    encoded bytes in order. Engines whose spec has ``multimodal`` take it beside text prompts; the
    processor expands each placeholder (``reroll.models.vision.VisionProcessor``)."""

    text: str
    images: tuple[bytes, ...]


Prompt = str | list[int] | ImagePrompt
"""A prompt as engines take it: text, token ids used as given, or text with images."""


@dataclass
class ImageInputs:
    """The vision inputs of some rows, as the Qwen2-VL family's processor makes them: ``pixel_values``
    ``(N, D)``, every image's patches one after another (D = channels x temporal patch x patch^2), and
    ``image_grid_thw`` long ``(K, 3)``, each image's patch grid (N = the sum of the grids' products)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.image_grid_thw.to(device))

    @staticmethod
    def join(parts: Sequence[ImageInputs | None]) -> ImageInputs | None:
        """The images of several rows, in row order (None where no row has any)."""
        kept = [p for p in parts if p is not None]
        if not kept:
            return None
        return ImageInputs(
            torch.cat([p.pixel_values for p in kept]), torch.cat([p.image_grid_thw for p in kept])
        )


class ImagePromptEncoder(Protocol):
    """What the data layer needs of a model's image processor (``reroll.models.vision.VisionProcessor``):
    a prompt's token ids with its image placeholders expanded, and its images' inputs."""

    def encode(self, text: str, images: Sequence[bytes]) -> tuple[list[int], ImageInputs | None]: ...


@dataclass(frozen=True)
class SamplingParams:
    """How actor_infer samples. ``temperature=0`` means greedy. ``logprobs``: return each sampled
    token's log-prob (``Completion.logprobs``); where False the hf and vllm engines return none.
    ``top_logprobs``: also the k most likely tokens at each step (``Completion.top_logprobs``; engines
    whose spec has ``top_logprobs``). ``json_schema``: the response must be JSON valid under this schema
    (JSON text), by the engine's guided decoding (engines whose spec has ``guided_decoding``)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    top_logprobs: int = 0
    json_schema: str | None = None


@dataclass
class Completion:
    """One response as the engine produced it: exact token ids and the sampled tokens' log-probs (one
    per response token, or none where ``SamplingParams.logprobs`` was False)."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "stop" (eos or a stop string), "length", or "abort" (interrupted: to continue)
    # SamplingParams.top_logprobs > 0: per response token, the k most likely (token id, log-prob), best first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def continued(self, more: Completion) -> Completion:
        """This response followed by ``more``, generated from this one's prompt + response tokens."""
        return Completion(
            self.prompt_ids,
            self.response_ids + more.response_ids,
            self.text + more.text,
            self.logprobs + more.logprobs,
            more.finish_reason,
            self.top_logprobs + more.top_logprobs,
        )


@dataclass
class TokenDelta:
    """What one engine step added to one response of a token stream (``Engine.stream_tokens``): sample
    ``sample`` of prompt ``prompt``, its new tokens with their log-probs (and top log-probs where asked),
    and ``finish_reason`` on the response's last delta (``None`` before)."""

    prompt: int
    sample: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Rollout:
    """A completion with the sample it answers and its group (all samples of one prompt share a group)."""

    sample: Sample
    group: int
    completion: Completion


@dataclass
class TrainBatch:
    """Padded tensors for training and scoring; see the module docstring for the layout.

    Optional fields are filled in as the step proceeds (rewards, then log-probs, then advantages).
    ``num_tokens`` / ``num_seqs`` are the counts over the whole optimizer step (all micro-batches, all
    ranks) so that each piece's loss is normalised as the full batch's would be.
    """

    input_ids: torch.Tensor  # long (B, T)
    attention_mask: torch.Tensor  # bool (B, T)
    response_mask: torch.Tensor  # bool (B, T)
    group_ids: torch.Tensor  # long (B,)
    rewards: torch.Tensor | None = None  # float (B,)
    rollout_logprobs: torch.Tensor | None = None  # float (B, T), from actor_infer
    old_logprobs: torch.Tensor | None = None  # float (B, T), from actor_train before the update
    ref_logprobs: torch.Tensor | None = None  # float (B, T), from reference
    advantages: torch.Tensor | None = None  # float (B, T)
    values: torch.Tensor | None = None  # float (B, T), the critic's V(x_<t) the advantages used
    returns: torch.Tensor | None = None  # float (B, T), the critic's targets
    baseline_rewards: torch.Tensor | None = None  # float (B,), ReMax's greedy-response reward
    # multi-turn episodes (agentic): the turn of each policy token (-1 elsewhere), each turn's reward
    # and the id of the observation it acted on (-1 for absent turns); S = the most turns in the batch
    step_ids: torch.Tensor | None = None  # long (B, T)
    step_rewards: torch.Tensor | None = None  # float (B, S)
    step_states: torch.Tensor | None = None  # long (B, S)
    # distillation: the teacher's log-probs of the batch's tokens (on-policy), or its top-k next-token
    # log-probs and their ids at each position (offline), aligned like the log-probs
    teacher_logprobs: torch.Tensor | None = None  # float (B, T)
    teacher_topk_logprobs: torch.Tensor | None = None  # float (B, T, K)
    teacher_topk_ids: torch.Tensor | None = None  # long (B, T, K)
    # vision-language rows: each row's images (ImageInputs), zero-padded per row to the batch's most
    # patches and images; a row without images has all-zero grids (``images()`` joins them back)
    pixel_values: torch.Tensor | None = None  # (B, P, D), in the model's dtype
    image_grid_thw: torch.Tensor | None = None  # long (B, K, 3)
    num_tokens: float | None = None
    num_seqs: float | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def select(self, index: torch.Tensor | slice) -> TrainBatch:
        """Rows ``index`` of every tensor; counts are kept (they describe the whole step)."""
        return replace(self, **{name: getattr(self, name)[index] for name in self._tensor_fields()})

    def split(self, n: int) -> list[TrainBatch]:
        """``n`` contiguous chunks of near-equal size (for data-parallel ranks)."""
        bounds = torch.linspace(0, len(self), n + 1).round().long().tolist()
        return [self.select(slice(a, b)) for a, b in itertools.pairwise(bounds)]

    def chunks(self, size: int) -> list[TrainBatch]:
        """Chunks of at most ``size`` rows (micro-batches), trimmed to their longest row."""
        out = []
        for start in range(0, len(self), size):
            part = self.select(slice(start, start + size))
            out.append(part.trim())
        return out

    def trim(self) -> TrainBatch:
        """Drop the padding columns that no row uses."""
        width = int(self.attention_mask.sum(-1).max()) if len(self) else 0
        width = max(width, 1)
        per_token = [
            n for n in self._tensor_fields() if n not in _PER_SEQUENCE and getattr(self, n).dim() >= 2
        ]
        return replace(self, **{name: getattr(self, name)[:, :width] for name in per_token})

    def images(self) -> ImageInputs | None:
        """The rows' images joined in row order (the model's ``pixel_values`` and ``image_grid_thw``);
        None where no row has any."""
        if self.image_grid_thw is None or self.pixel_values is None:
            return None
        parts = []
        for pixels, grids in zip(self.pixel_values, self.image_grid_thw):
            grids = grids[grids.prod(-1) > 0]
            n = int(grids.prod(-1).sum())
            parts.append(ImageInputs(pixels[:n], grids) if n else None)
        return ImageInputs.join(parts)

    @staticmethod
    def concat(parts: Sequence[torch.Tensor], width: int | None = None, pad: float = 0.0) -> torch.Tensor:
        """Concatenate ``(b_i, T_i)`` tensors along rows, right-padded to ``width`` (default: the widest)."""
        width = width or max(p.shape[1] for p in parts)
        padded = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad) for p in parts]
        return torch.cat(padded, dim=0)


# fields not indexed by token: ``trim`` leaves them whole ((B, S) by turn; each row's image inputs)
_PER_SEQUENCE = ("step_rewards", "step_states", "pixel_values", "image_grid_thw")


def padded_images(
    rows: Sequence[ImageInputs | None], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``TrainBatch.pixel_values`` ``(B, P, D)`` and ``image_grid_thw`` ``(B, K, 3)`` of each row's images
    (None: a row without any), zero-padded per row; ``pixel_values`` in ``dtype``."""
    kept = [r for r in rows if r is not None]
    if not kept:
        raise ValueError("padded_images: no row has images")
    dim = kept[0].pixel_values.shape[-1]
    most_patches = max(r.pixel_values.shape[0] for r in kept)
    most_images = max(r.image_grid_thw.shape[0] for r in kept)
    pixels = torch.zeros((len(rows), most_patches, dim), dtype=dtype)
    grids = torch.zeros((len(rows), most_images, 3), dtype=torch.long)
    for i, r in enumerate(rows):
        if r is not None:
            pixels[i, : r.pixel_values.shape[0]] = r.pixel_values.to(dtype)
            grids[i, : r.image_grid_thw.shape[0]] = r.image_grid_thw
    return pixels, grids


@dataclass(frozen=True)
class RewardItem:
    """What a reward worker scores: the prompt (the user message), the response, the dataset row and
    the row's domain."""

    prompt: str
    response: str
    row: dict[str, Any]
    domain: str = "default"

    @classmethod
    def answering(cls, sample: Sample, completion: Completion) -> RewardItem:
        """The item for ``completion``, a response to ``sample``; the reward's ``prompt`` is the user
        message (the prompt template's text, before any chat template)."""
        return cls(sample.text, completion.text, sample.row, sample.domain)


def prompt_response_batch(
    rows: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_token_id: int,
    group_ids: Sequence[int] | None = None,
) -> TrainBatch:
    """Right-padded ``(B, T)`` tensors of ``(prompt ids, response ids)`` rows, the response masked for the
    loss; ``group_ids`` default to one group per row."""
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.bool)
    resp = torch.zeros_like(attn)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.long)
        attn[i, : len(p) + len(r)] = True
        resp[i, len(p) : len(p) + len(r)] = True
    groups = torch.arange(len(rows)) if group_ids is None else torch.tensor(list(group_ids), dtype=torch.long)
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        group_ids=groups,
        num_tokens=float(resp.sum()),
        num_seqs=float(resp.any(-1).sum()),
    )


def build_train_batch(rollouts: Sequence[Rollout], pad_token_id: int) -> TrainBatch:
    """Right-padded ``(B, T)`` tensors from rollouts; ``rollout_logprobs`` sit on the response tokens
    (None where the engine returned no log-probs: ``SamplingParams.logprobs`` False)."""
    rows = [(r.completion.prompt_ids, r.completion.response_ids) for r in rollouts]
    batch = prompt_response_batch(rows, pad_token_id, [r.group for r in rollouts])
    if not any(r.completion.logprobs for r in rollouts):
        return batch
    batch.rollout_logprobs = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for i, (p, r) in enumerate(rows):
        if rollouts[i].completion.logprobs:
            batch.rollout_logprobs[i, len(p) : len(p) + len(r)] = torch.tensor(
                rollouts[i].completion.logprobs, dtype=torch.float32
            )
    return batch
