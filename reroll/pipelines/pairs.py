"""What the preference pipelines (reward_model, dpo) share: the pairs (with their prompts' images), their
sampler and batches, and held-out pair metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from reroll.algorithms.preference import bradley_terry_loss
from reroll.config.schema import RunConfig
from reroll.config.vision import image_field
from reroll.data.datasets import PromptSampler
from reroll.data.preferences import PairBatch, PreferencePair, load_pairs, pair_batch
from reroll.models.loading import DTYPES
from reroll.pipelines.common import image_reader, prompt_format, write_synthetic_files

log = logging.getLogger(__name__)


def write_synthetic_pairs(cfg: RunConfig) -> None:
    """Write the synthetic pairs ``preference.synthetic`` asks for, where its files do not exist yet."""
    prefs = cfg.preference
    assert prefs is not None
    syn = prefs.synthetic
    targets = [Path(prefs.train_files[0]), *(Path(f) for f in prefs.eval_files[:1])]
    if syn is None:
        return
    from reroll.data.preferences import write_arithmetic_preferences

    writer = partial(write_arithmetic_preferences, negatives=syn.negatives)
    write_synthetic_files(writer, syn, targets, "preference")


def load_preference_data(cfg: RunConfig, tokenizer: Any) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Training and held-out pairs, every row checked (a bad one names its file and row). With a
    ``data`` section (dpo's warm start and evaluation) string pairs are rendered in its prompt format,
    so what DPO trains on is what the SFT warm start and the evaluation see; without one, as written."""
    prefs = cfg.preference
    assert prefs is not None
    fmt = prompt_format(cfg, tokenizer) if cfg.section("data") is not None else None
    kw = {"fmt": fmt, "id_field": prefs.id_field, "image_field": image_field(cfg)}
    train = load_pairs(prefs.train_files, tokenizer, **kw)
    held_out = (
        load_pairs(prefs.eval_files, tokenizer, **kw, limit=prefs.eval_limit) if prefs.eval_files else []
    )
    return train, held_out


PairEncoder = Callable[[Sequence[PreferencePair]], PairBatch]
"""Pairs to the batch a trainer takes (``pair_batch`` with the run's tokenizer and image processor)."""


def pair_encoder(cfg: RunConfig, tokenizer: Any, pairs: Sequence[PreferencePair]) -> PairEncoder:
    """``pair_batch`` for the run's ``pairs``: where they have images, after the checks of a run with images
    (``image_reader``: the model reads them, the placeholders match), with the model's image processor
    and the pixels in ``model.dtype``."""
    vision = image_reader(cfg, tokenizer, pairs)
    return partial(pair_batch, tokenizer=tokenizer, vision=vision, dtype=DTYPES[cfg.model.dtype])


def pair_sampler(cfg: RunConfig, pairs: list[PreferencePair]) -> PromptSampler:
    """Each step's ``preference.batch_size`` pairs, reshuffled every epoch, resumable."""
    assert cfg.preference is not None
    return PromptSampler(pairs, cfg.preference.batch_size, seed=cfg.seed, shuffle=cfg.preference.shuffle)  # type: ignore[arg-type]


def pair_texts(pairs: Iterable[PreferencePair]) -> Iterable[str]:
    """The pairs' text as written (what the coverage check at start reads), else as rendered."""
    for p in pairs:
        yield from p.written or (p.prompt, p.chosen, p.rejected)


def batches(pairs: Sequence[PreferencePair], encode: PairEncoder, size: int) -> Iterable[PairBatch]:
    """``pairs`` in order as batches of at most ``size`` (scoring many pairs without one huge padding)."""
    for start in range(0, len(pairs), size):
        yield encode(pairs[start : start + size])


def reward_pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor, prefix: str) -> dict[str, float]:
    """A reward model's numbers on pairs: pairwise accuracy, mean margin, reward mean and std."""
    loss, m = bradley_terry_loss(chosen, rejected)
    both = torch.cat([chosen, rejected])
    return {
        f"{prefix}/accuracy": float(m["accuracy"].mean()),
        f"{prefix}/margin": float(m["margin"].mean()),
        f"{prefix}/loss": float(loss.mean()),
        f"{prefix}/reward_mean": float(both.mean()),
        f"{prefix}/reward_std": float(both.std(unbiased=False)),
    }
