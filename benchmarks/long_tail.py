"""A random-init model whose response lengths are geometric: ``benchmarks/grpo_step.py --lengths long-tail``.

    python benchmarks/long_tail.py MODEL_DIR [--mean 512]   # edit a saved model in place, print the check

At every position the end-of-sequence token's probability is about ``1 / mean``, whatever came before,
so a sampled response ends after a geometric number of tokens (mean ``mean``; a cap of 4,096 new tokens
cuts e^-8 of them at mean 512). Every row of the bench (reroll's and the peers') samples from the same
edited model file, so they all see the same length distribution, tail included.

The construction, on a Qwen2-architecture model (``edit_long_tail``):

1. One coordinate ``d`` of the residual stream is made a constant ``c``: every token's embedding has
   ``c`` there, and the output row ``d`` of every layer's ``o_proj`` and ``down_proj`` (the only writes to
   the residual stream) is zeroed. After the final RMSNorm that coordinate is ``c * w[d] / rms(h)``.
2. ``c`` is made several times the norm of the rest of the final residual stream, so ``rms(h)``, and with
   it the normed coordinate, varies little from one position to the next (by ``(r / c)^2`` of the rest's
   variation, ``r`` that norm).
3. EOS's head row is zeroed but for coordinate ``d``, where it is ``2c``; the other rows have ``c`` there
   (a head tied to the embedding) or 0 (a head of its own), the same for every one of them, which softmax
   cancels. So EOS's logit over the others' is ``gap * n_d`` (``gap`` c or 2c), and the final norm's
   weight on ``d`` sets its size: it is calibrated on random contexts so that EOS's logit sits
   ``log(mean - 1)`` below the log-sum-exp of the others (p / (1 - p) = 1 / (mean - 1)). Every value in
   the head stays a small multiple of ``c``, so bf16 keeps the margin to 2^-9 of itself (a first version
   put a small ``a`` on top of a tied ``c`` of 263 at the 0.5B shape: bf16 rounded it away, p(EOS) 1).
   RMSNorm fixes the norm of the normed state, so the others' log-sum-exp over ~150k tokens barely moves
   between positions either.

``check_long_tail`` measures p(EOS) * mean at every position of fresh random contexts (about 1 where the
construction holds).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

# how many times the rest of the final residual stream's norm the constant coordinate is: its normed value
# moves by about (1/K)^2 of the rest's relative variation (K 4: 20 % -> 1.2 %, about 0.07 in EOS's logit)
CONSTANT_OVER_REST = 4.0


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def _final_norm_io(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The final RMSNorm's input and output at every position of ``ids`` (B, T): each (B, T, H)."""
    seen: dict[str, torch.Tensor] = {}

    def hook(_module, inputs, output):
        seen["in"], seen["out"] = inputs[0].detach(), output.detach()

    handle = model.model.norm.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model.model(input_ids=ids)
    finally:
        handle.remove()
    return seen["in"].float(), seen["out"].float()


def random_contexts(vocab: int, eos: int, *, rows: int, length: int, seed: int) -> torch.Tensor:
    """(rows, length) token ids drawn uniformly from the vocabulary but EOS (a sampled response's
    tokens: a random-init model's samples spread over the whole vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (rows, length), generator=g)
    return ids + (ids >= eos).long()  # skip EOS


def edit_long_tail(
    model: torch.nn.Module, eos: int, *, mean: float, rows: int = 4, length: int = 64, seed: int = 0
) -> dict[str, float]:
    """Edit ``model`` (a Qwen2-architecture causal LM, fp32 for the calibration) in place so that
    p(EOS) is about ``1 / mean`` at every position (the module docstring's construction). Returns what it
    set: the coordinate, the constant ``c`` and the final norm's weight on it."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    norm = model.model.norm.weight
    tied = head.data_ptr() == embed.data_ptr()
    d = embed.shape[1] - 1  # the constant coordinate: the last one (any would do)
    ids = random_contexts(embed.shape[0], eos, rows=rows, length=length, seed=seed)
    with torch.no_grad():
        for layer in _layers(model):  # nothing writes to coordinate d any more
            layer.self_attn.o_proj.weight[d].zero_()
            layer.mlp.down_proj.weight[d].zero_()
        embed[:, d] = 0.0
        if not tied:
            head[:, d] = 0.0
        # c several times the rest's norm; the layers see the constant too (it dilutes their normed
        # inputs), which moves the rest's norm: two rounds settle it
        c = 0.0
        for _ in range(2):
            final, _ = _final_norm_io(model, ids)
            rest = final[..., :d].norm(dim=-1).median().item()
            c = CONSTANT_OVER_REST * rest
            embed[:, d] = c
        # EOS's row: 2c on coordinate d, nothing elsewhere (tied: its embedding too, read by no position
        # that matters, as nothing follows EOS); the others' rows have c (tied) or 0 there. Every value in
        # the head stays a small multiple of c, so bf16 keeps EOS's margin over the others to 2^-9 of it;
        # the margin's size is set by the final norm's weight on d, a number of its own
        head[eos] = 0.0
        head[eos, d] = 2 * c
        gap = 2 * c - (c if tied else 0.0)
        norm[d] = 1.0
        _, normed = _final_norm_io(model, ids)
        unit = normed[..., d].reshape(-1)  # the normed coordinate at weight 1: c / rms(h)
        rest_logits = normed.reshape(-1, normed.shape[-1])[:, :d] @ head.float()[:, :d].T
        rest_logits[:, eos] = -math.inf
        lse = torch.logsumexp(rest_logits, dim=-1)  # the others' log-sum-exp without coordinate d
        # EOS's logit over the others': gap * w * unit = lse - log(mean - 1), as p / (1 - p) = 1 / (mean - 1)
        w = ((lse - math.log(mean - 1)) / (gap * unit)).median().item()
        norm[d] = w
    return {"coordinate": d, "constant": c, "norm_weight": w, "tied": float(tied)}


def eos_probabilities(model: torch.nn.Module, eos: int, *, rows: int, length: int, seed: int) -> torch.Tensor:
    """p(EOS) at every position (rows * length,) of fresh random contexts, computed in fp32."""
    ids = random_contexts(
        model.get_input_embeddings().weight.shape[0], eos, rows=rows, length=length, seed=seed
    )
    _, normed = _final_norm_io(model, ids)
    logits = normed.reshape(-1, normed.shape[-1]) @ model.get_output_embeddings().weight.float().T
    return torch.softmax(logits, dim=-1)[:, eos]


def make_long_tail(model_dir: Path, *, mean: float = 512.0, seed: int = 0) -> dict[str, float]:
    """Edit the model saved at ``model_dir`` in place (calibrated in fp32, saved back in its dtype) so that
    response lengths are geometric with mean ``mean``; returns ``edit_long_tail``'s values and the check of
    the saved weights (``check_long_tail``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = config.eos_token_id
    done = edit_long_tail(model, eos, mean=mean, seed=seed)
    model.to(dtype).save_pretrained(model_dir, safe_serialization=True)
    return done | check_long_tail(model.float(), eos, mean=mean, seed=seed + 1)


def check_long_tail(
    model: torch.nn.Module, eos: int, *, mean: float, rows: int = 4, length: int = 64, seed: int = 1
) -> dict[str, float]:
    """p(EOS) x ``mean`` over every position of fresh random contexts: its least, median and most (1 where
    the lengths are geometric with mean ``mean``)."""
    ratio = eos_probabilities(model, eos, rows=rows, length=length, seed=seed) * mean
    return {
        "ratio_min": ratio.min().item(),
        "ratio_median": ratio.median().item(),
        "ratio_max": ratio.max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--mean", type=float, default=512.0, help="the mean response length (1 / p(EOS))")
    args = ap.parse_args()
    print(make_long_tail(args.model_dir, mean=args.mean))


if __name__ == "__main__":
    main()
