"""benchmarks/long_tail.py: a random-init model edited so that p(EOS) is 1/mean at every position, so
sampled lengths are geometric (the bench's ``--lengths long-tail``); on a tiny model with Qwen2.5's
vocabulary, whose ~150k logits are the sum the calibration has to beat."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.long_tail import make_long_tail
from reroll.models.tiny import build_tiny_model

VOCAB = 151936  # Qwen2.5's


def sample_lengths(model, eos: int, *, n: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``n`` responses of up to ``cap`` tokens at temperature 1 (the whole vocabulary, as the
    bench's rows); each one's length, EOS included, and whether it ended."""
    g = torch.Generator().manual_seed(0)
    ids = torch.full((n, 4), 5)
    past = None
    step_ids = ids
    lengths = torch.full((n,), cap)
    ended = torch.zeros(n, dtype=torch.bool)
    with torch.no_grad():
        for t in range(cap):
            out = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1, generator=g)
            now = (token[:, 0] == eos) & ~ended
            lengths[now] = t + 1
            ended |= now
            if ended.all():
                break
            step_ids = token
    return lengths, ended


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_eos_probability_is_one_over_mean_everywhere(tmp_path, tied):
    model_dir = build_tiny_model(
        tmp_path / "m", alphabet="abc ", vocab_size=VOCAB, dtype="bfloat16", tie_word_embeddings=tied
    )
    # checked on the saved bf16 weights at positions of contexts the calibration never saw
    seen = make_long_tail(model_dir, mean=512.0)
    # the edit ran, on the head the model has
    assert seen["tied"] == float(tied) and seen["constant"] > 0
    # the bench's bound: within 1.5x of 1/512 at every position (the construction's spread: ~(r/c)^2 of
    # the rest's norm's variation, ~1 % at c = 4r, plus the median's calibration and bf16's 2^-9 margin)
    assert 1 / 1.5 < seen["ratio_min"] <= seen["ratio_max"] < 1.5


def test_sampled_lengths_are_geometric(tmp_path):
    """Sampled to the end: the mean length of n responses is that of geometric(1/mean) (a smaller
    vocabulary than above, for the sampler's sake: the calibration is the same)."""
    mean, n, cap = 8.0, 128, 112
    model_dir = build_tiny_model(tmp_path / "m", alphabet="abc ", vocab_size=4096)
    make_long_tail(model_dir, mean=mean)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = model.config.eos_token_id
    lengths, ended = sample_lengths(model, eos, n=n, cap=cap)
    # the sampling ran and ended nearly every response (P(len > 112) = (7/8)^112 ~ 3e-7)
    assert ended.float().mean() > 0.99
    # geometric(p = 1/8): mean 8, sd sqrt(1 - p) / p = 7.5, so the mean of 128 has sd 0.66: 4 sd
    sd = math.sqrt(1 - 1 / mean) * mean / math.sqrt(n)
    assert abs(lengths.float().mean().item() - mean) < 4 * sd
