"""Loading a causal LM and computing per-token log-probs: the one place both trainer and engine use."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from reroll.errors import UserError

hf_logging.disable_progress_bar()  # one line per step is ours; no per-load progress bars

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the model; pad falls back to eos."""
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise UserError(f"cannot load a tokenizer from model.path {path!r}: {e}") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A Hugging Face causal LM from a local directory or hub id, in ``dtype`` on ``device``."""
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    except OSError as e:
        raise UserError(f"cannot load a model from model.path {str(path)!r}: {e}") from e
    return model.to(device)


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding: 0, 1, 2, ... over the real tokens of each row."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(x_t | x_<t) for every position: ``(B, T, V)`` logits, ``(B, T)`` ids -> ``(B, T)``; column 0 is 0.

    Logits are divided by ``temperature`` first (as the engine samples), so the ratio the policy loss
    sees is the one of the sampling distribution.
    """
    scaled = logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0), value=0.0)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution, aligned like ``token_logprobs``: ``(B, T, V)`` -> ``(B, T)``."""
    scaled = logits[:, :-1].float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)


def sequence_logprobs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Forward ``model`` on right-padded rows and return ``(B, T)`` token log-probs."""
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask)
    )
    return token_logprobs(out.logits, input_ids, temperature)


def mismatch_metrics(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's on the same tokens (``mismatch/*``)."""
    diff = (trainer.detach().float() - engine.float())[mask]
    if not diff.numel():
        return {}
    # k3 estimate of KL(engine || trainer) over the sampled tokens
    log_ratio = -diff
    kl = (log_ratio.exp() - 1 - log_ratio).mean()
    return {
        "mismatch/logprob_abs_mean": float(diff.abs().mean()),
        "mismatch/logprob_abs_max": float(diff.abs().max()),
        "mismatch/kl": float(kl),
    }
