"""Per-token log-probs and entropy read off a causal LM's logits, in the one alignment the losses use.

Column ``t`` belongs to token ``t`` and is read off the model's output at position ``t - 1``, the
last position that has not seen token ``t``; column 0 is 0 (``reroll.data.types``). The critic's
values follow the same alignment (``reroll.algorithms.value.token_values``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(x_t | x_<t) for every position: ``(B, T, V)`` logits, ``(B, T)`` ids -> ``(B, T)``; column 0 is 0.

    Logits are divided by ``temperature`` first (as the engine samples), so the ratio the policy loss
    sees is the one of the sampling distribution.
    """
    scaled = logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0), value=0.0)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the next-token distribution, aligned like ``token_logprobs``: ``(B, T, V)`` -> ``(B, T)``."""
    scaled = logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)
