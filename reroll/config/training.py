"""The trainers' sections: the optimizer and batch shape (``optim``), the strategy (``strategy``), the critic (``critic``) and SFT (``sft``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from reroll.config.base import StrictModel
from reroll.config.data import DataSource


class OptimConfig(StrictModel):
    """Optimizer and batch shape of actor_train."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps, then constant.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per forward/backward on one rank.")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Dynamic micro-batching: fill each micro-batch up to this many tokens instead of "
        "micro_batch_size rows (None: off).",
    )
    logprob_micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per forward-only pass (reference and old log-probs, critic values): these "
        "keep no activations for backward, so they can batch larger than training. None (with "
        "logprob_max_tokens_per_micro_batch unset): on a GPU, as many rows (or tokens) as hold one training "
        "micro-batch's memory, from the model's shape (reroll plan prints the size; training's where "
        "colocated roles never offload); off GPUs, training's micro_batch_size / max_tokens_per_micro_batch.",
    )
    logprob_max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Token budget of a forward-only pass, like max_tokens_per_micro_batch. Either logprob_* "
        "setting replaces both training limits for those passes. Results do not depend on either.",
    )
    packing: bool | None = Field(
        None,
        description="Pack a micro-batch's rows into one sequence without padding; each row attends only to "
        "itself, at its own cost (reroll.models.packed_attention: torch's variable-length flash-attention "
        "kernel on CUDA, sdpa row by row elsewhere), so no layer computes padding. Models whose attention "
        "cannot be switched (sliding windows, soft-capping, not sdpa) pack on sdpa's block-diagonal mask, "
        "whose attention costs the square of the packed length. None (the default): on where the trainer "
        "(a causal LM) runs on CUDA in bf16/fp16 with that kernel, off elsewhere (CPU, fp32, score "
        "heads). On an H100 it trained a batch of 16-256-token responses about 9% faster than padded "
        "rows and one of uniform length about 3% slower (docs/benchmarks.md, Packed rows).",
    )
    group_by_length: bool = Field(
        True,
        description="Cut micro-batches from a step's rows sorted by length (longest first), so rows of "
        "similar length share one and little padding is computed (a long-tailed RL batch: about half the "
        "tokens). Losses, gradients and per-row outputs equal those of row order up to float rounding. "
        "Rows that fit in one micro-batch, and preference pairs, keep their order.",
    )
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per rollout batch (PPO mini-batches).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over the rollout batch.")
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="An optimizer step whose loss or gradient norm is NaN/inf is skipped (no update; "
        "counted as train/nonfinite_skipped and logged with the batch's statistics); this many skipped "
        "in a row stop the run with that diagnostic (1: stop at the first).",
    )


class CriticConfig(StrictModel):
    """PPO's learned value function (adv_estimator 'gae'); one step per mini-batch, like the actor."""

    model_path: str | None = Field(
        None, description="Hub id or local directory the critic starts from (default: model.path)."
    )
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps, then constant.")
    value_clip: float | None = Field(
        0.2, gt=0, description="Clip new values to within this of the old ones in the loss (PPO); None: off."
    )


class FSDP2Config(StrictModel):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded."""

    param_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Compute dtype of the sharded parameters (mixed precision); None: model.dtype."
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype gradients are reduced in across ranks."
    )
    reshard_after_forward: bool = Field(
        True,
        description="Free gathered parameters after forward (ZeRO-3-like); False keeps them (ZeRO-2-like).",
    )
    cpu_offload: bool = Field(
        False, description="Keep parameters, gradients and optimizer state on CPU between uses."
    )


class LoRAConfig(StrictModel):
    """Low-rank adapters (peft) on the policy: only the adapters train."""

    rank: int = Field(16, ge=1, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is (alpha / rank) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names of the linear layers that get adapters.",
    )
    sync: Literal["adapters", "merged"] = Field(
        "adapters",
        description="Weight sync sends the adapters only, or the base weights with the adapters merged in.",
    )


class DeepSpeedConfig(StrictModel):
    """DeepSpeed ZeRO (pip install 'reroll[deepspeed]')."""

    zero_stage: Literal[2, 3] = Field(
        2, description="ZeRO stage: 2 shards gradients+optimizer, 3 also params."
    )
    offload_optimizer: bool = Field(False, description="Optimizer state and step on CPU.")
    offload_params: bool = Field(False, description="Parameters on CPU between uses (stage 3 only).")


class MegatronConfig(StrictModel):
    """Megatron-Core (pip install 'reroll[megatron]', GPUs only): model parallel sizes and options."""

    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size.")
    pipeline_parallel: int = Field(
        1,
        ge=1,
        description="Pipeline-parallel size: stages of consecutive layers (evenly where it divides them, "
        "else fewer on the first and last stage, as Megatron-Core splits them), a micro-batch crossing them "
        "in turn.",
    )
    virtual_pipeline: int = Field(
        1,
        ge=1,
        description="Model chunks per pipeline stage (Megatron-Core's interleaved schedule, virtual pipeline "
        "stages): each stage holds this many non-consecutive runs of num_layers / (pipeline_parallel x "
        "virtual_pipeline) layers and a micro-batch crosses every stage this many times, which shrinks the "
        "pipeline's idle time by about this factor at the cost of more point-to-point traffic and of more "
        "activations held on the first stage ((2 (pp - 1) + (vp - 1) pp + 1) / vp micro-batches' worth "
        "against pp). Needs pipeline_parallel > 1. A mixture of experts with context_parallel runs its "
        "micro-batches one after the other (unscheduled), each through every chunk in turn; a scheduled "
        "step of fewer than pipeline_parallel micro-batches gets one-token fillers. 1: off.",
    )
    context_parallel: int = Field(
        1,
        ge=1,
        description="Context parallelism: groups of this many of actor_train's (and the reference's) ranks "
        "split every sequence between them, each a contiguous 1/n of its tokens, attention by Ulysses "
        "all-to-alls over the heads in Megatron-Core's local attention (no Transformer Engine needed); "
        "tensor_parallel x context_parallel must divide the attention and key-value heads; with "
        "sequence_parallel each rank's tokens are split again over its TP ranks (rows padded to a multiple "
        "of context_parallel x tensor_parallel). 1: off.",
    )
    expert_parallel: int = Field(1, ge=1, description="Expert-parallel size (MoE models).")
    sequence_parallel: bool = Field(
        False,
        description="At tensor_parallel > 1, split the activations outside attention and the MLP (norms, "
        "residuals, a mixture of experts' routing) along the sequence over the TP ranks; runs with or "
        "without Transformer Engine. A mixture of experts at tensor_parallel > 1 needs it.",
    )
    distributed_optimizer: bool = Field(
        True,
        description="Shard optimizer state across data-parallel ranks (not with strategy.lora: the "
        "adapters' state is small and stays whole on each rank).",
    )
    transformer_engine: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Layer spec: Transformer Engine where installed ('auto'), required, or never (with "
        "strategy.lora 'auto' takes the local spec: the adapters sit on its linear layers).",
    )

    @field_validator("transformer_engine", mode="before")
    @classmethod
    def _on_off(cls, value: object) -> object:
        """YAML reads a bare on / off as true / false: take them as the words they were."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class StrategyConfig(StrictModel):
    """The training backend of actor_train, reference and critic."""

    name: Literal["auto", "torch", "fsdp2", "deepspeed", "megatron"] = Field(
        "auto",
        description="'torch': one full copy per rank, gradients all-reduced; 'fsdp2': sharded (FSDP2); "
        "'deepspeed': ZeRO-2/3; 'megatron': Megatron-Core model parallelism (GPUs). 'auto': fsdp2 where "
        "actor_train has several GPU ranks or a `strategy.fsdp2` option is set, otherwise torch (one fsdp2 "
        "rank shards nothing and is slower); the run's config.yaml and `reroll plan` show the choice.",
    )
    fsdp2: FSDP2Config = Field(default_factory=FSDP2Config, description="FSDP2 settings.")
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig, description="DeepSpeed settings.")
    megatron: MegatronConfig = Field(default_factory=MegatronConfig, description="Megatron-Core settings.")
    context_parallel: int = Field(
        1,
        ge=1,
        description="Context parallelism (fsdp2): groups of this many of actor_train's (and the reference's) "
        "ranks split every sequence between them, attention by Ulysses all-to-alls over the heads, so a "
        "rank holds 1/n of a long row's activations; world_size must be a multiple (data-parallel ranks: "
        "world_size / n) and n must divide the model's attention and key-value heads. optim's micro-batch "
        "limits are a group's (each rank computes 1/n of their tokens). 1: off.",
    )
    lora: LoRAConfig | None = Field(
        None,
        description="Train low-rank adapters instead of all weights (torch, fsdp2 and deepspeed "
        "strategies); a reward model (pipeline reward_model) trains its score head in full beside them and "
        "saves the adapters merged into model/.",
    )

    @property
    def synced_adapters(self) -> LoRAConfig | None:
        """``lora`` where a weight sync sends actor_infer the adapters alone (``lora.sync: adapters``)."""
        return self.lora if self.lora is not None and self.lora.sync == "adapters" else None


class SFTConfig(StrictModel):
    """Supervised fine-tuning on prompt/answer rows (a pipeline of its own, or RLVR's warm start)."""

    steps: int = Field(100, ge=0, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Rows per optimizer step.")
    lr: float = Field(1e-3, gt=0, description="Learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps, then constant.")
    files: list[DataSource] | None = Field(
        None, description="Rows to learn from, in the forms of data.train_files (default: data.train_files)."
    )
    target_template: str = Field(
        "{answer}", description="What the model should answer, over the row's fields."
    )
