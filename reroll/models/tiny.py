"""Tiny models built locally: a character-level tokenizer and a random-init Qwen2 causal LM, or a
Qwen3-MoE one (mixture of experts).

Used by tests, examples and the quickstart, so that nothing is downloaded from the Hugging Face hub.
The model is a real ``Qwen2ForCausalLM`` (``Qwen3MoeForCausalLM``): the HF training path and vLLM both
load it like any other checkpoint.
"""

from __future__ import annotations

import logging
import string
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3MoeConfig,
)
from transformers.utils import logging as hf_logging

from reroll.config.alphabet import parse_alphabet
from reroll.data.arithmetic import ARITHMETIC_ALPHABET

if TYPE_CHECKING:
    from reroll.config.model import TinyMoEConfig

log = logging.getLogger(__name__)

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# The text of the shipped games (``reroll.envs``: nim's "pile 13", "you win"): digits, lowercase, a few marks.
GAME_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz .,:-"

# Any ASCII text: digits, letters, punctuation and whitespace (Python's `string.printable`, 100 characters).
ASCII_ALPHABET = string.printable

ALPHABETS: dict[str, str] = {
    "arithmetic": ARITHMETIC_ALPHABET,
    "game": GAME_ALPHABET,
    "ascii": ASCII_ALPHABET,
}
"""The named alphabets of ``model.build_tiny.alphabet`` and ``reroll make-tiny-model --alphabet``; the
config knows their names as ``reroll.config.alphabet.ALPHABET_NAMES`` (a test keeps the two equal)."""

# Qwen2's pre-tokenizer split (transformers' `tokenization_qwen2.PRETOKENIZE_REGEX`).
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# vLLM's CPU attention backend supports these head sizes among the ones a tiny model would use.
SUPPORTED_HEAD_DIMS = (32, 64)

# Each message is `<|role|>content`; an assistant turn ends with `<eos>` (the end-of-response token).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def resolve_alphabet(name_or_chars: str) -> str:
    """The characters of an alphabet as the config and the CLI take it: a name of ``ALPHABETS``
    (``"arithmetic"``), ``"chars:<characters>"``, or the characters themselves (``"0123456789+-= "``).

    The rules are ``reroll.config.alphabet.parse_alphabet``'s; a bad value raises its ``ValueError``.
    """
    name, chars = parse_alphabet(name_or_chars)
    return ALPHABETS[name] if name is not None else chars


def char_tokenizer(alphabet: str, *, chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of ``alphabet``, plus ``<pad>``, ``<eos>``, ``<unk>``.

    Ids: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then ``<|system|>``, ``<|user|>``, ``<|assistant|>``
    (the chat template's role markers), then the alphabet in order. No BOS/EOS is added on encode.
    ``padding_side`` is left to the caller. With ``chat_template`` (the default) it carries
    ``CHAT_TEMPLATE`` (``<|user|>12+34<|assistant|>``, an assistant turn ending with ``<eos>``);
    without, it has none, as a base model's tokenizer (the role tokens stay in the vocabulary).

    It is a byte-level BPE with no merges and exactly the pipeline of ``Qwen2Tokenizer``: for a
    ``qwen2`` checkpoint, transformers 5 (and so vLLM) always rebuilds the tokenizer as
    ``Qwen2Tokenizer`` from the saved vocab, whatever class was saved, so only this construction
    encodes the same before and after a reload. A consequence: characters outside ``alphabet`` are
    dropped on encode (that BPE has no unknown token); ``reroll.data.coverage.lost_characters`` finds
    them in a run's texts.
    """
    chars = list(dict.fromkeys(alphabet))  # dedupe, keep order
    if not chars:
        raise ValueError(
            "char_tokenizer: alphabet is empty; pass the characters the task uses, e.g. '0123456789+='"
        )
    non_ascii = [c for c in chars if not c.isascii()]
    if non_ascii:
        raise ValueError(
            f"char_tokenizer: alphabet has non-ASCII characters {non_ascii}, which a byte-level tokenizer "
            "with no merges would split into several tokens; use ASCII characters only"
        )
    specials = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in chars:
        vocab[_byte_symbol(ord(char))] = len(vocab)

    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        clean_up_tokenization_spaces=False,
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    *,
    alphabet: str,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 128,
    vocab_size: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    for_cpu_engine: bool = True,
    chat_template: bool = True,
    moe: TinyMoEConfig | None = None,
    tie_word_embeddings: bool = True,
    init_device: str = "cpu",
) -> Path:
    """Save a random-init ``Qwen2ForCausalLM`` (fp32 unless ``dtype``) and its ``char_tokenizer(alphabet)`` to ``out_dir``.

    Embeddings are tied unless ``tie_word_embeddings`` is off (Qwen2.5-7B's shape has a head of its
    own); ``num_kv_heads`` defaults to ``num_heads`` and ``intermediate_size`` to
    ``4 * hidden_size``. ``vocab_size`` larger than the tokenizer's pads the embedding (the shape of a
    real model for speed measurements; ids past the tokenizer decode to nothing). The same ``seed``
    gives the same weights. ``for_cpu_engine`` checks the head size against vLLM's CPU backend (turn it
    off for a model meant for GPUs, e.g. Qwen2.5-3B's head size 128); ``chat_template=False`` saves a
    tokenizer without one. ``moe`` (a ``model.build_tiny.moe`` section) makes it a
    ``Qwen3MoeForCausalLM`` whose every decoder layer's MLP is ``moe.experts`` experts
    (``intermediate_size`` is then unused). ``init_device`` other than 'cpu' (a benchmark's 'cuda')
    initialises the weights there, in ``dtype``: seconds for a 7B shape, other random values than a
    CPU's. Returns ``out_dir`` as a ``Path``,
    loadable offline with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check_dims(hidden_size, num_heads, num_kv_heads, for_cpu_engine)
    tokenizer = char_tokenizer(alphabet, chat_template=chat_template)
    shape = dict(
        vocab_size=max(vocab_size or 0, len(tokenizer)),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype=dtype,
    )
    if moe is None:
        config: PretrainedConfig = Qwen2Config(
            **shape, intermediate_size=intermediate_size or 4 * hidden_size, use_sliding_window=False
        )
    else:
        config = moe_config(shape, moe)
    torch.manual_seed(seed)
    if init_device == "cpu":
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    else:  # a benchmark's 7B shape: initialised in fp32 on a CPU it took minutes of a lent GPU's call
        with torch.device(init_device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model = model.cpu()
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        do_sample=False,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one shard, written in milliseconds: no "Writing model shards" bar
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    return out


def moe_config(shape: dict[str, object], moe: TinyMoEConfig) -> Qwen3MoeConfig:
    """A Qwen3-MoE config of ``shape`` (``build_tiny_model``'s dense keys) with ``moe``'s experts (a
    validated ``model.build_tiny.moe``): every layer sparse, the top-k probabilities renormalised
    (``norm_topk_prob``, as Qwen3-30B-A3B), head size ``hidden_size // num_attention_heads``."""
    hidden, heads = int(shape["hidden_size"]), int(shape["num_attention_heads"])  # type: ignore[call-overload]
    aux = moe.router_aux_loss_coef
    return Qwen3MoeConfig(
        **shape,
        head_dim=hidden // heads,
        intermediate_size=4 * hidden,  # the dense MLP of layers listed in mlp_only_layers: none here
        moe_intermediate_size=moe.expert_hidden_size or 2 * hidden,
        num_experts=moe.experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001 if aux is None else aux,
        output_router_logits=aux is not None,
        use_sliding_window=False,
    )


def build_tiny_reward_model(
    path: str | Path,
    *,
    alphabet: str = ARITHMETIC_ALPHABET,
    hidden_size: int = 32,
    num_layers: int = 1,
    seed: int = 0,
) -> Path:
    """A tiny random Qwen2 sequence classifier with one label (a Bradley-Terry reward model's shape) and its
    character tokenizer, saved at ``path``: what tests and benchmarks score with, built offline."""
    from transformers import Qwen2ForSequenceClassification

    tok = char_tokenizer(alphabet)
    heads = max(1, hidden_size // 32)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=128, num_labels=1,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def _check_dims(hidden_size: int, num_heads: int, num_kv_heads: int, for_cpu_engine: bool = True) -> None:
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}); "
            f"pick num_heads so that hidden_size // num_heads is one of {SUPPORTED_HEAD_DIMS}"
        )
    head_dim = hidden_size // num_heads
    if for_cpu_engine and head_dim not in SUPPORTED_HEAD_DIMS:
        fixes = ", ".join(
            f"num_heads={hidden_size // d}" for d in SUPPORTED_HEAD_DIMS if hidden_size % d == 0
        )
        raise ValueError(
            f"head_dim = hidden_size // num_heads = {hidden_size} // {num_heads} = {head_dim}, but vLLM's CPU "
            f"backend supports head_dim in {SUPPORTED_HEAD_DIMS}; "
            + (
                f"use {fixes}"
                if fixes
                else f"use a hidden_size that is a multiple of {SUPPORTED_HEAD_DIMS[0]}"
            )
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads}); "
            f"use a divisor of {num_heads}, or leave num_kv_heads unset to use num_heads"
        )


def _byte_symbol(byte: int) -> str:
    """The byte-level BPE symbol of one byte (GPT-2's ``bytes_to_unicode``): printable bytes stay
    themselves, the others map past U+0100 in order (space is "Ġ", newline "Ċ")."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))
