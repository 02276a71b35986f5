"""The policy model's section (``model``): where it loads from, its dtype, and the tiny model built offline."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from reroll.config.alphabet import Alphabet
from reroll.config.base import StrictModel


class TinyMoEConfig(StrictModel):
    """Make the tiny model a mixture of experts: a Qwen3-MoE (transformers' ``Qwen3MoeForCausalLM``, the
    architecture of Qwen3-30B-A3B and -235B-A22B) whose every decoder layer's MLP is ``experts`` expert
    MLPs, each token sent to the ``top_k`` that a linear router scores highest, their outputs weighted by
    the router's probabilities renormalised over those ``top_k``."""

    experts: int = Field(4, ge=2, le=64, description="Experts per decoder layer (num_experts).")
    top_k: int = Field(
        2, ge=1, description="Experts each token is routed to (num_experts_per_tok), at most `experts`."
    )
    expert_hidden_size: int | None = Field(
        None,
        ge=32,
        multiple_of=32,
        description="Each expert's MLP width (moe_intermediate_size), a multiple of 32 (vLLM's CPU MoE "
        "kernel's alignment); unset: 2 * hidden_size (with top_k 2, a token's experts together are as wide "
        "as the dense tiny model's MLP).",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Written to config.json as router_aux_loss_coef with output_router_logits true: the "
        "model trains with the router's load-balancing loss at this weight unless model.router_aux_loss_coef "
        "says otherwise. Unset: Qwen3-MoE's 0.001 with output_router_logits false, as Qwen3-30B-A3B ships "
        "(no load-balancing loss by default).",
    )

    @model_validator(mode="after")
    def _top_k_within_experts(self) -> TinyMoEConfig:
        if self.top_k > self.experts:
            raise ValueError(
                f"top_k ({self.top_k}) must be at most experts ({self.experts}): a token is routed to top_k "
                f"distinct experts; lower top_k or raise experts"
            )
        return self


class TinyModelConfig(StrictModel):
    """Build a small random-init model offline (for tests and the quickstart): a Qwen2, or with ``moe`` a
    Qwen3-MoE."""

    alphabet: Alphabet = Field(
        "arithmetic",
        description="The tokenizer's characters: a name, 'arithmetic' (digits, +-*= and space), 'game' "
        "(the shipped games' text) or 'ascii' (Python's string.printable), or the characters themselves, "
        "quoted, e.g. '0123456789+-=abc ' (ASCII only). A value of letters only is a name; write "
        "letters-only characters with the prefix 'chars:', e.g. 'chars:abc'.",
    )
    hidden_size: int = Field(128, ge=32, description="Width; hidden_size / num_heads must be 32 or 64.")
    num_layers: int = Field(2, ge=1, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    seed: int = Field(0, description="Seed of the random init.")
    chat_template: bool = Field(
        True,
        description="Give the tokenizer a chat template ('<|user|>...<|assistant|>', turns ending with "
        "'<eos>'); false: none, as a base model's tokenizer.",
    )
    vision: bool = Field(
        False,
        description="Build a vision-language model of Qwen2.5-VL's architecture (a 2-block vision tower "
        "on 4-pixel patches, its merger, the text model above) with an image processor for images up to "
        "32x32 pixels, instead of a text-only Qwen2.",
    )
    moe: TinyMoEConfig | None = Field(
        None,
        description="Build a mixture-of-experts model (Qwen3-MoE) instead of a dense Qwen2, e.g. "
        "{experts: 4, top_k: 2}.",
    )

    @model_validator(mode="after")
    def _one_architecture(self) -> TinyModelConfig:
        if self.vision and self.moe is not None:
            raise ValueError(
                "vision and moe are both set: the tiny builder makes a vision-language Qwen2.5-VL or a "
                "text-only Qwen3-MoE, not both; drop one of them"
            )
        return self


class ModelConfig(StrictModel):
    """The policy model."""

    path: str = Field(description="Hugging Face hub id or local directory (config.json, weights, tokenizer).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    build_tiny: TinyModelConfig | None = Field(
        None, description="If set and `path` does not exist yet, build a tiny random model there first."
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="Mixture-of-experts models: the router's load-balancing loss (Switch Transformer's, as "
        "transformers computes it; an even load gives top_k) times this is added to every training loss "
        "(policy, SFT, distillation, DPO). Unset: the model's own setting, config.json's "
        "router_aux_loss_coef where its output_router_logits is true, else 0 (Qwen3-30B-A3B ships false). "
        "0 turns it off. The router statistics (<prefix>/router_aux_loss, /expert_load_max, /expert_load_min, "
        "/expert_load_entropy) are logged either way; ignored for dense models.",
    )
    gradient_checkpointing: bool | int | Literal["auto"] = Field(
        False,
        description="Recompute decoder layers' activations in backward to save memory: true every layer, "
        "false none, a count N the first N (what each keeps and why the first: "
        "reroll.config.memory.kept_activations), 'auto' the fewest first layers that make a training "
        "role's phase fit its GPU beside a colocated vLLM engine's share, so that the engine stays awake "
        "(placement.offload auto), else alone, by `reroll plan`'s estimate (on GPUs, from the longest prompt seen "
        "and raised as longer ones come; none on CPUs). 'auto': torch and fsdp2 strategies; a count: those and megatron (dense models, "
        "pipeline_parallel 1); deepspeed: true or false.",
    )
    compile: bool = Field(
        False,
        description="torch.compile the trained and reference models' decoder layers (the torch strategy; "
        "dynamic shapes, so sequence lengths do not recompile, and the layers share one compiled graph). "
        "Off by default: the first step compiles (27 s instead of 5 at the 0.5B shape on an H100), then "
        "training and the reference pass ran 15-17 % faster there; not yet measured at larger shapes, "
        "with LoRA or with fsdp2; docs/benchmarks.md.",
    )
    fused_norm: bool = Field(
        True,
        description="Run the model's RMSNorm layers as torch's fused rms_norm in the trainers (torch, fsdp2 "
        "and deepspeed strategies): on a GPU one kernel each way instead of about eight fp32 elementwise "
        "ones, and fewer activations kept for backward. Only norm classes whose own forward computes the "
        "plain weight * x / rms(x) are switched (checked on a probe at load; Gemma's 1 + weight is not); "
        "results differ by bf16 rounding, none in fp32. false: the model's own code.",
    )
    fused_head: bool = Field(
        False,
        description="true: in the trainers (torch and fsdp2 strategies), the response tokens' log-probs and "
        "entropy are computed from the last hidden states and the head's weight a chunk at a time, forward "
        "and backward (the backward computes the chunks' logits again), so a micro-batch's (tokens x "
        "vocabulary) logits are never kept: memory for time. On an H100 at the 0.5B shape (64 rows of 384 "
        "tokens a pass) the training pass took 1.27 s a batch at its GPU chunk (about 1,766 tokens) against "
        "1.06 s on the logits path, for a peak 6.5 GiB lower (benchmarks/train_passes.py): turn it on where "
        "the logits are what does not fit (long responses, large vocabularies). Models whose head is not a "
        "plain linear layer, or whose forward changes the head's output, keep the logits path by themselves; "
        "deepspeed and megatron always take it. false (default): the response positions' logits, kept for "
        "backward.",
    )
    batched_vision_attention: bool = Field(
        True,
        description="In the trainers (torch, fsdp2 and deepspeed strategies), a vision-language model's vision "
        "tower attends over its images and windows in one SDPA call per distinct length (windows of "
        "equal size batched), not transformers' sdpa loop of one call per window and image (~7,000 calls "
        "a forward of Qwen2.5-VL-3B's tower at 16 images of 448 px). Same math, fp32 rounding apart; no "
        "flash-attn needed; the text model's attention is unchanged. false: transformers' loop. Ignored "
        "for text-only models.",
    )
    train_vision: bool = Field(
        False,
        description="A vision-language model's vision tower (and its merger into the text model) trains "
        "with the rest; false: it keeps its loaded weights (no gradients or optimizer state, and weight "
        "sync sends only what trains). Ignored for text-only models.",
    )
    cudnn_attention: bool = Field(
        False,
        description="Let torch's attention (SDPA, in the trainers and the hf engine) use cuDNN's kernels, "
        "which torch picks first on Hopper and newer GPUs. cuDNN builds a plan for every new attention "
        "shape (rows, length, padded or not: hundreds of ms each, once per process), and RL micro-batches "
        "bring new lengths every step; off, torch runs flash attention (no padding) or its memory-efficient "
        "kernel (padding), which need no build. vLLM's attention is its own. Ignored on CPU.",
    )

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing_value(cls, value: object) -> object:
        if isinstance(value, bool) or value == "auto" or (isinstance(value, int) and value >= 0):
            return value
        raise ValueError(
            f"{value!r} is not a checkpointing setting: use true (every decoder layer), false (none), "
            "a count of layers >= 0 (the first ones), or 'auto' (the fewest that fit the GPU)"
        )
