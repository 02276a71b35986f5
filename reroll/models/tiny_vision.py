"""A tiny vision-language model built locally: Qwen2.5-VL's architecture at a few hundred thousand
parameters, its character tokenizer with the vision tokens, a chat template that places images, and a
Qwen2-VL image processor for small images. Nothing is downloaded; ``AutoModelForImageTextToText``,
``AutoTokenizer`` and ``AutoImageProcessor`` load the directory (and vLLM, where it runs the family)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.utils import logging as hf_logging

from reroll.models.tiny import _check_dims, char_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# The tiny chat template, with Qwen2-VL's image placeholder for each image part of a message's content.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

PATCH = 4  # pixels a side of a vision patch
MERGE = 2  # patches a side merged into one image token


def build_tiny_vl_model(
    out_dir: str | Path,
    *,
    alphabet: str,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    max_pixels: int = 32 * 32,
    seed: int = 0,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 256,
    vision_intermediate_size: int | None = None,
    vision_num_heads: int | None = None,
    patch_size: int = PATCH,
    dtype: str = "float32",
    for_cpu_engine: bool = True,
) -> Path:
    """Save a random-init ``Qwen2_5_VLForConditionalGeneration`` (fp32 unless ``dtype``), its tokenizer
    and image processor to ``out_dir``. The vision tower embeds ``patch_size``-pixel patches (4 by
    default; two frames each, as Qwen2-VL's temporal patch: a still image is repeated), runs
    ``vision_depth`` blocks (every eighth and the last with full attention, the others windowed) and
    merges 2x2 patches into one token of the text model's width: a 32x32 image is 16 image tokens.
    Images are scaled to between 16x16 and ``max_pixels`` pixels.

    The defaults are the tiny model of the CPU tests; the other arguments give a real model's shape for
    speed measurements (``benchmarks/vision_step.py``: Qwen2.5-VL-3B's), with ``num_kv_heads`` (default
    ``num_heads``), ``intermediate_size`` (default ``2 * hidden_size``), ``vocab_size`` larger than the
    tokenizer's (padding the embedding, as ``build_tiny_model`` does), and ``for_cpu_engine=False`` for
    head sizes vLLM's CPU backend lacks."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _check_dims(hidden_size, num_heads, num_kv_heads, for_cpu_engine)
    tokenizer = char_tokenizer(alphabet)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    head_dim = hidden_size // num_heads
    section = [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]  # Qwen2.5-VL's 16:24:24 of 128, halved
    section[0] += head_dim // 2 - sum(section)
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": max(vocab_size or 0, len(tokenizer)),
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size or 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None,
        },
        vision_config={
            "depth": vision_depth,
            "hidden_size": vision_hidden_size,
            "intermediate_size": vision_intermediate_size or 2 * vision_hidden_size,
            "num_heads": vision_num_heads or max(1, vision_hidden_size // 16),
            "patch_size": patch_size,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "window_size": 4 * patch_size * MERGE,
            "out_hidden_size": hidden_size,
            # Qwen2.5-VL-3B's 32 blocks attend fully at 7, 15, 23, 31; the tiny two blocks at 1
            "fullatt_block_indexes": sorted({*range(7, vision_depth, 8), vision_depth - 1}),
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        do_sample=False,
    )
    processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=MERGE,
        min_pixels=16 * 16,
        max_pixels=max_pixels,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    return out
