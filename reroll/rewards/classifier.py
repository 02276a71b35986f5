"""A sequence-classification reward model (``AutoModelForSequenceClassification``) loaded from a path.

The model scores ``template.format(prompt=..., response=...)``; the reward is the logit of label
``label`` (a one-label head is the usual Bradley-Terry reward model). Each worker loads the model
once (per path) on CPU and keeps it; calls from the worker's threads share it under a lock.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

from reroll.rewards.base import RewardResult

_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def load_classifier(path: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from ``path``, in eval mode; cached per path."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    return model, tokenizer


def classifier_score(
    prompt: str,
    response: str,
    sample: Mapping[str, Any],
    *,
    path: str,
    template: str = "{prompt}{response}",
    label: int = 0,
    max_length: int = 1024,
) -> RewardResult:
    """The reward model's logit for (prompt, response); details: ``truncated`` 0/1."""
    import torch

    with _LOCK:
        model, tokenizer = load_classifier(path)
        text = template.format(prompt=prompt, response=response)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        truncated = int(ids.shape[1] > max_length)
        ids = ids[:, -max_length:] if ids.shape[1] else torch.tensor([[tokenizer.pad_token_id]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    return RewardResult(float(logits[0, label]), {"truncated": truncated})
