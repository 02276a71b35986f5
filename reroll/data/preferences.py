"""Preference pairs: rows ``{"prompt", "chosen", "rejected"}`` read through ``datasets.read_rows``, checked,
rendered to text, and made into the paired tensors the reward-model and DPO pipelines train on.

A row's fields are strings, or chat message lists (``[{"role": "user", "content": ...}, ...]``): the
prompt's messages, and the assistant turn(s) of each response. ``render_pair`` is the one place a row
becomes text (message lists through the tokenizer's chat template). A bad row (a missing field, an
empty text, chosen equal to rejected) is a ``DatasetError`` naming its file and row.

A row's prompt may carry images (the run's image field, ``reroll.data.images``: each must open, else the
error names the row), shared by its chosen and its rejected response: the chat template places them
before the prompt's text (a vision-language model's), and ``pair_batch`` gives both batch rows of the
pair the prompt's expanded image tokens and its pixels, so the policy and the reference score each
response with the image it answers.

``write_arithmetic_preferences`` makes synthetic pairs from the arithmetic task: the correct answer is
preferred to a near miss (one digit or the carry wrong, as a partly trained model errs).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from reroll.data.arithmetic import make_arithmetic_rows, write_splits
from reroll.data.chat import PromptFormat, chat_messages
from reroll.data.datasets import DatasetError, read_rows
from reroll.data.images import row_images
from reroll.data.types import (
    ImageInputs,
    ImagePromptEncoder,
    TrainBatch,
    padded_images,
    prompt_response_batch,
)

FIELDS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """One rendered pair: the prompt text and the two responses' text (``uid``: file and row, or the id);
    ``images``: the prompt's images, encoded, in the order its placeholders stand (none: text only);
    ``written``: the row's text as written (each field's string, or each message's content), what the
    start-of-run coverage check reads (the rendered prompt holds the chat template's special tokens)."""

    uid: str
    prompt: str
    chosen: str
    rejected: str
    images: tuple[bytes, ...] = ()
    written: tuple[str, ...] = field(default=(), compare=False)  # derived from the row: not its identity


def check_preference_row(file: str, index: int, row: dict[str, Any]) -> None:
    """``row`` (the ``index``-th of ``file``, from 0) has a non-empty prompt, chosen and rejected, each a
    string or a list of chat messages, and chosen differs from rejected."""
    where = f"{file}: row {index + 1}"
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise DatasetError(
            f"{where} has no field {missing[0]!r}: a preference row needs {list(FIELDS)} (the row has "
            f"{sorted(row)}); rename the fields or fix the row"
        )
    for key in FIELDS:
        value = row[key]
        if isinstance(value, list):
            bad = next((m for m in value if not _is_message(m)), None) if value else "[]"
            if bad is not None:
                raise DatasetError(
                    f"{where}: {key!r} is a list but {bad!r} is not a chat message "
                    f'{{"role": ..., "content": "..."}}: give a string or a list of messages'
                )
            text = "".join(m["content"] for m in value)
        elif isinstance(value, str):
            text = value
        else:
            raise DatasetError(
                f"{where}: {key!r} is a {type(value).__name__}; it must be a string or a list of chat messages"
            )
        if not text.strip():
            raise DatasetError(f"{where}: {key!r} is empty: every pair needs a prompt and two responses")
    if row["chosen"] == row["rejected"]:
        raise DatasetError(
            f"{where}: 'chosen' and 'rejected' are the same ({_short(row['chosen'])}): a pair must prefer one "
            f"response to a different one; drop the row"
        )


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def render_pair(
    row: dict[str, Any], tokenizer: Any = None, fmt: PromptFormat | None = None, images: int = 0
) -> tuple[str, str, str]:
    """``(prompt, chosen, rejected)`` text of a checked row: strings as they are, unless ``fmt`` (the
    run's ``PromptFormat``) uses the chat template, which then wraps them as a user message (with the
    system prompt) and an assistant reply, as rlvr and sft render prompts; message lists through the
    tokenizer's chat template (the prompt with the generation prompt, each response as the text the
    template adds after it). ``images``: how many images the prompt carries, placed as image parts
    before the (first) user message's text, where the chat template writes their placeholders, as
    ``PromptFormat.prompt`` places a row's. The one place preference rows become text."""
    prompt = row["prompt"]
    if isinstance(prompt, str) and isinstance(row["chosen"], str) and isinstance(row["rejected"], str):
        if fmt is None or not fmt.chat:
            if images:
                raise DatasetError(
                    f"the prompt has {images} images, which only a chat template places (a vision-language "
                    "model's), and these pairs are rendered as written (data.chat_template false, or auto "
                    "and the tokenizer has none, or no data section): use such a model with "
                    "data.chat_template auto or true (pipeline dpo without a data section: add one)"
                )
            return prompt, row["chosen"], row["rejected"]
        prompt, images = chat_messages(prompt, fmt.system_prompt, images=images), 0  # placed
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            "preference rows with chat message lists or images need a tokenizer with a chat template: "
            "the model's tokenizer has none; give the fields as strings, without images"
        )
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    messages = _with_image_parts(messages, images) if images else messages
    head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def response(value: str | list[dict[str, str]]) -> str:
        turns = value if isinstance(value, list) else [{"role": "assistant", "content": value}]
        full = tokenizer.apply_chat_template([*messages, *turns], tokenize=False)
        if not full.startswith(head):  # a template that renders the last turn differently: keep the turns
            return "".join(t["content"] for t in turns)
        text = full[len(head) :]
        eos = getattr(tokenizer, "eos_token", None)
        return text[: -len(eos)] if eos and text.endswith(eos) else text  # pair_batch appends eos

    return head, response(row["chosen"]), response(row["rejected"])


def _written(value: str | list[dict[str, Any]]) -> tuple[str, ...]:
    """A field's text as the row writes it: the string, or each message's string content."""
    if isinstance(value, str):
        return (value,)
    return tuple(m["content"] for m in value if isinstance(m.get("content"), str))


def _with_image_parts(messages: list[dict[str, Any]], images: int) -> list[dict[str, Any]]:
    """``messages`` with ``images`` image parts before the first user message's text."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        raise DatasetError("a pair's prompt has images but no user message to place them in: add one")
    parts = chat_messages(messages[first]["content"], images=images)[0]
    return [*messages[:first], parts, *messages[first + 1 :]]


def load_pairs(
    files: Sequence[str],
    tokenizer: Any = None,
    *,
    fmt: PromptFormat | None = None,
    id_field: str = "id",
    limit: int | None = None,
    image_field: str | None = None,
) -> list[PreferencePair]:
    """Every row of ``files`` checked (``check_preference_row``) and rendered (``render_pair``), with its
    prompt's images from ``image_field`` (None: none read), each checked to open (``row_images``: paths
    are read relative to the file's directory)."""
    pairs: list[PreferencePair] = []
    for file in files:
        for i, row in enumerate(read_rows(file)):
            check_preference_row(file, i, row)
            where = f"{file}: row {i + 1}"
            images = row_images(where, row, image_field, Path(file).parent) if image_field else ()
            try:
                prompt, chosen, rejected = render_pair(row, tokenizer, fmt, images=len(images))
            except DatasetError as e:
                raise DatasetError(f"{where}: {e}") from e
            uid = str(row.get(id_field, f"{file}:{i + 1}"))
            written = tuple(_written(row[k]) for k in FIELDS)
            pairs.append(PreferencePair(uid, prompt, chosen, rejected, images, sum(written, ())))
            if limit is not None and len(pairs) >= limit:
                return pairs
    if not pairs:
        raise DatasetError(
            f"no rows in {list(files)}: the preference files are empty; add rows or fix the paths"
        )
    return pairs


@dataclass
class PairBatch:
    """Pairs as two right-padded ``TrainBatch``es, row i of ``chosen`` against row i of ``rejected``
    (prompt + response + eos; ``response_mask`` on the response and eos). ``ref_chosen`` /
    ``ref_rejected``: the reference's sequence log-probs ``(P,)`` where the loss needs them;
    ``num_pairs``: the pairs of the whole optimizer step (all micro-batches, all ranks); a prompt's
    images sit on both of its rows (``pixel_values`` / ``image_grid_thw`` of each side, padded alike);
    ``pad_token_id`` fills the padding (a sequence-classification head reads the last non-pad token)."""

    chosen: TrainBatch
    rejected: TrainBatch
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None
    num_pairs: float | None = None
    pad_token_id: int = 0

    def __len__(self) -> int:
        return len(self.chosen)

    def select(self, index: torch.Tensor | slice) -> PairBatch:
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return replace(
            self,
            chosen=self.chosen.select(index).trim(),
            rejected=self.rejected.select(index).trim(),
            ref_chosen=pick(self.ref_chosen),
            ref_rejected=pick(self.ref_rejected),
        )

    def split(self, n: int) -> list[PairBatch]:
        """``n`` contiguous chunks of near-equal size (for data-parallel ranks); pairs stay whole."""
        bounds = torch.linspace(0, len(self), n + 1).round().long().tolist()
        return [self.select(slice(a, b)) for a, b in itertools.pairwise(bounds)]

    def stacked(self) -> TrainBatch:
        """One batch of 2P rows, the chosen then the rejected, right-padded to one width (one forward)."""
        width = max(self.chosen.input_ids.shape[1], self.rejected.input_ids.shape[1])
        cat = lambda a, b, pad: TrainBatch.concat([a, b], width, pad)  # noqa: E731
        c, r = self.chosen, self.rejected
        both = lambda a, b: None if a is None or b is None else torch.cat([a, b])  # noqa: E731
        return TrainBatch(
            input_ids=cat(c.input_ids, r.input_ids, self.pad_token_id).long(),
            attention_mask=cat(c.attention_mask, r.attention_mask, False).bool(),
            response_mask=cat(c.response_mask, r.response_mask, False).bool(),
            group_ids=torch.cat([c.group_ids, r.group_ids]),
            pixel_values=both(c.pixel_values, r.pixel_values),  # the sides share their padded shapes
            image_grid_thw=both(c.image_grid_thw, r.image_grid_thw),
        )

    def proxy(self) -> TrainBatch:
        """One row per pair whose real tokens are the pair's (chosen and rejected), ``group_ids`` the pair
        index: what ``micro_batches`` cuts by rows and tokens without splitting a pair."""
        mask = torch.cat([self.chosen.attention_mask, self.rejected.attention_mask], dim=1)
        return TrainBatch(
            input_ids=torch.zeros(mask.shape, dtype=torch.long),
            attention_mask=mask,
            response_mask=torch.zeros_like(mask),
            group_ids=torch.arange(len(self)),
        )


def pair_batch(
    pairs: Sequence[PreferencePair],
    tokenizer: Any,
    vision: ImagePromptEncoder | None = None,
    dtype: torch.dtype = torch.float32,
) -> PairBatch:
    """Tokenised pairs: prompt + response + eos, the loss and the reward on the response and eos. With
    ``vision`` (the model's ``VisionProcessor``; needed where a pair has images), each prompt's image
    placeholders are expanded and its images processed once, and both rows of the pair, chosen and
    rejected, carry them (``pixel_values`` in ``dtype``, ``image_grid_thw``), as ``sft_batch`` and
    ``with_images`` give a row its sample's."""
    if vision is None and any(p.images for p in pairs):
        raise ValueError("pair_batch: the pairs have images, so it needs the model's VisionProcessor")
    prompts: list[tuple[list[int], ImageInputs | None]] = [
        vision.encode(p.prompt, p.images)
        if p.images and vision is not None
        else (tokenizer.encode(p.prompt, add_special_tokens=False), None)
        for p in pairs
    ]
    found = [i for _, i in prompts]
    images = padded_images(found, dtype) if any(i is not None for i in found) else None

    def side(responses: list[str]) -> TrainBatch:
        rows = []
        for (p, _), response in zip(prompts, responses):
            r = tokenizer.encode(response, add_special_tokens=False)
            rows.append((p, [*r, tokenizer.eos_token_id]))
        batch = prompt_response_batch(rows, tokenizer.pad_token_id)
        if images is not None:
            batch.pixel_values, batch.image_grid_thw = images
        return batch

    return PairBatch(
        chosen=side([p.chosen for p in pairs]),
        rejected=side([p.rejected for p in pairs]),
        num_pairs=float(len(pairs)),
        pad_token_id=int(tokenizer.pad_token_id),
    )


def near_miss(answer: int, rng: random.Random) -> int:
    """A wrong answer close to ``answer`` (never negative where ``answer`` is not): one digit off by one
    or more, or the tens or hundreds carry wrong."""
    candidates = {answer + d for d in (-100, -10, -2, -1, 1, 2, 10, 100)}
    digits = str(abs(answer))
    for i in range(len(digits)):  # one digit changed to any other
        for d in "0123456789":
            if d != digits[i] and not (i == 0 and d == "0" and len(digits) > 1):
                candidates.add(int(("-" if answer < 0 else "") + digits[:i] + d + digits[i + 1 :]))
    candidates.discard(answer)
    if answer >= 0:
        candidates = {c for c in candidates if c >= 0}
    return rng.choice(sorted(candidates))


def make_arithmetic_preferences(
    n: int, *, max_operand: int = 99, ops: Sequence[str] = ("+",), seed: int = 0, negatives: int = 1
) -> list[dict[str, Any]]:
    """Pairs over the ``n`` problems ``make_arithmetic_rows(n, ...)`` draws (the same seed: the same
    problems, in the same order): prompt ``"12+34="``, chosen the answer, rejected a ``near_miss``.
    Rows keep ``question`` and ``answer``, so exact match can score generations against them."""
    return [p for pairs in _pairs_by_problem(n, max_operand, ops, seed, negatives) for p in pairs]


def _pairs_by_problem(
    n: int, max_operand: int, ops: Sequence[str], seed: int, negatives: int
) -> list[list[dict[str, Any]]]:
    """Each problem's ``negatives`` pairs, each with a different near miss. The first is the one a
    single negative draws (the others come from a second generator), so adding negatives leaves it."""
    rng, extra = random.Random(seed * 7_919 + 1), random.Random(seed * 7_919 + 2)
    out = []
    for row in make_arithmetic_rows(n, max_operand=max_operand, ops=ops, seed=seed):
        answer = int(row["answer"])
        wrong = [near_miss(answer, rng)]
        for _ in range(50 * negatives):  # distinct near misses (any answer has at least 9)
            if len(wrong) >= negatives:
                break
            if (w := near_miss(answer, extra)) not in wrong:
                wrong.append(w)
        pair = {**row, "prompt": f"{row['question']}=", "chosen": row["answer"]}
        out.append(
            [
                {**pair, "id": row["id"] if k == 0 else f"{row['id']}-{k}", "rejected": str(w)}
                for k, w in enumerate(wrong)
            ]
        )
    return out


def write_arithmetic_preferences(
    out_dir: str | Path,
    *,
    n_train: int,
    n_test: int,
    max_operand: int = 99,
    ops: Sequence[str] = ("+",),
    seed: int = 0,
    negatives: int = 1,
) -> dict[str, Path]:
    """``train.jsonl`` and ``test.jsonl`` of arithmetic preferences; the split is the one
    ``write_arithmetic_dataset`` makes with the same arguments, so its held-out questions stay unseen.
    Training problems get ``negatives`` pairs each, held-out ones their first (the same for any
    ``negatives``, so held-out pairwise accuracies compare)."""
    problems = _pairs_by_problem(n_train + n_test, max_operand, ops, seed, negatives)
    splits = {
        "train": [p for pairs in problems[:n_train] for p in pairs],
        "test": [pairs[0] for pairs in problems[n_train:]],
    }
    return write_splits(out_dir, splits)
