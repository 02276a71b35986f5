"""The generation engine interface of actor_infer: every engine (hf, vllm, sglang) has these methods."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from reroll.data.types import Completion, SamplingParams


class Engine(Protocol):
    """Generates, takes new weights in place, and reports its own metrics.

    Log-probs are those of the sampled tokens at the sampling temperature (as the trainer's
    ``token_logprobs``), so the two can be compared on every batch. Engines also offer
    ``score(input_ids, attention_mask, temperature)`` for tests (hf: any temperature, vllm: 1.0), and
    vllm/sglang ``sleep()`` / ``wake_up()`` for colocation on GPUs.
    """

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions for each prompt, in prompt order."""
        ...

    def update_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load new parameter values (Hugging Face names) without reloading from disk."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (tokens/s, ...)."""
        ...
