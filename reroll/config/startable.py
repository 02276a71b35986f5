"""Whether this version of reroll can start a config: one check for ``reroll validate``, ``reroll plan`` and
the run.

``start_problems`` lists, as ``(dotted path, message)``, every reason a run of the config would be refused
while its roles are created that the config alone decides (with the device type and the model's type where
they are known): parallel sizes the Megatron strategy does not build, options a strategy or engine does not
take. ``reroll validate`` and ``run()`` (through ``reroll.pipelines.preflight``), ``reroll plan`` and the run's ``ResourceManager`` (once the device type is
known) all call it, and the strategies and engines raise the same messages from the same functions when
built directly, so a config ``plan`` passes is one the run starts, and what the run refuses ``validate``
and ``plan`` refuse first, with the same words.

Not here, because the config does not decide them: whether a package is installed, whether the Ray
cluster holds the roles (``reroll.config.placement.cluster_problems``), what a checkpoint or the data hold.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from reroll.config.engines import engine_spec
from reroll.config.memory import known_shape
from reroll.config.placement import (
    offload_between_phases,
    role_device,
    run_roles,
    shares_device,
)
from reroll.config.vision import vision_model_problems

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig
    from reroll.config.training import MegatronConfig

# Model types the Megatron strategy converts (reroll.models.megatron_convert).
MEGATRON_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama")
# Hugging Face model types of the known families by name prefix, for hub ids that are not on disk.
KNOWN_MODEL_TYPES = {
    "qwen2.5-vl-": "qwen2_5_vl",
    "qwen2-vl-": "qwen2_vl",
    "qwen2.5-": "qwen2",
    "qwen2-": "qwen2",
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen3-235b-a22b": "qwen3_moe",
    "qwen3-": "qwen3",
    "llama-": "llama",
    "meta-llama-3": "llama",
}


def model_type(path: str) -> str | None:
    """The Hugging Face ``model_type`` of ``model.path``: its config.json when local, else the known family
    its name starts with; None when neither tells."""
    config = Path(path) / "config.json"
    try:
        found = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        return found if isinstance(found, str) else None
    except (OSError, ValueError, AttributeError):
        pass
    name = path.lower().rsplit("/", 1)[-1]
    for prefix in sorted(KNOWN_MODEL_TYPES, key=len, reverse=True):
        if name.startswith(prefix):
            return KNOWN_MODEL_TYPES[prefix]
    return None


def megatron_parallel_problems(
    world_size: int, m: MegatronConfig, role: str = "<role>", context_parallel: int = 1
) -> list[str]:
    """What the Megatron strategy cannot do with ``world_size`` ranks under ``m``'s parallel sizes;
    ``context_parallel``: the role's (``context_parallel_size``: ``m.context_parallel`` for the roles that
    split sequences, else 1)."""
    problems = []
    cp = context_parallel
    model_parallel = m.tensor_parallel * m.pipeline_parallel * cp
    if world_size % model_parallel:
        problems.append(
            f"the role's world_size ({world_size}) must be divisible by strategy.megatron tensor_parallel "
            f"({m.tensor_parallel}) x pipeline_parallel ({m.pipeline_parallel}) x context_parallel "
            f"({cp}) = {model_parallel}: change roles.{role}.world_size or the parallel sizes"
        )
    elif (world_size // model_parallel) % m.expert_parallel:  # EP groups lie within the data-parallel ranks
        problems.append(
            f"strategy.megatron.expert_parallel ({m.expert_parallel}) must divide the data-parallel size "
            f"(roles.{role}.world_size {world_size} / (tensor_parallel x pipeline_parallel x "
            f"context_parallel) = {world_size // model_parallel}): change expert_parallel or the world_size"
        )
    problems += virtual_pipeline_problems(None, m.pipeline_parallel, m.virtual_pipeline)
    return problems


def megatron_context_parallel_problems(c: Any, m: MegatronConfig, size: int) -> list[str]:
    """Why the model of Hugging Face config ``c`` cannot split its sequences over ``size`` ranks in the
    Megatron strategy (``reroll.strategies.megatron_context``): each rank attends with 1/size of its
    tensor-parallel shard's heads, so ``tensor_parallel x size`` must divide the attention and the
    key-value heads (a mixture of experts' router loss pools a row's columns over the group's ranks:
    ``reroll.strategies.megatron_moe.SplitRouted``)."""
    if size == 1:
        return []
    split = m.tensor_parallel * size
    return [
        f"strategy.megatron.context_parallel ({size}) x tensor_parallel ({m.tensor_parallel}) = "
        f"{split} must divide the model's {name} ({n}): each context-parallel rank attends with 1/{size} "
        f"of its tensor-parallel shard's heads; use a context_parallel of {fits}"
        for name, n, fits in _unsplit_heads(c, m.tensor_parallel, size)
    ]


def _unsplit_heads(c: Any, per: int, size: int) -> list[tuple[str, int, list[int]]]:
    """The head counts of config ``c`` (attention, key-value) that ``per x size`` ranks cannot split
    evenly, each as ``(its field, its count, the sizes k for which per x k splits both)``."""
    heads = getattr(c, "num_attention_heads", None)
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    fits = [
        k
        for k in range(1, (kv_heads or 1) + 1)
        if (kv_heads or 1) % (per * k) == 0 and (heads or 1) % (per * k) == 0
    ]
    return [
        (name, n, fits)
        for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
        if isinstance(n, int) and n % (per * size)
    ]


def pipeline_stage_sizes(num_layers: int, pp: int) -> list[int]:
    """The decoder layers of each of ``pp`` pipeline stages, as Megatron-Core splits them: evenly where
    ``pp`` divides ``num_layers``, else ``ceil(num_layers / pp)`` on each middle stage and the rest
    shared by the first and last (fewer there: they also hold the embedding and the head); empty where
    that leaves the first stage no layer."""
    if pp == 1 or num_layers % pp == 0:
        return [num_layers // pp] * pp
    middle = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * middle
    first = rest // 2
    return [] if first < 1 else [first, *[middle] * (pp - 2), rest - first]


def pipeline_split_problem(num_layers: int, pp: int) -> str:
    """Why ``pipeline_stage_sizes`` cannot split ``num_layers`` over ``pp`` stages."""
    return (
        f"strategy.megatron.pipeline_parallel ({pp}) leaves a pipeline stage no layer of the model's "
        f"{num_layers} (num_hidden_layers): pick a smaller pipeline_parallel"
    )


def virtual_pipeline_problems(num_layers: int | None, pp: int, vp: int) -> list[str]:
    """Why ``num_layers`` decoder layers cannot be split over ``pp`` pipeline stages of ``vp`` model
    chunks each (the interleaved schedule; ``virtual_stage_layers``): model chunks need stages, and every
    chunk the same number of layers, so ``pp x vp`` must divide them (Megatron-Core's uneven first and
    last stages would also need their counts divisible by ``vp``; not offered). ``num_layers`` None (the
    model not read): the layout alone."""
    if vp == 1:
        return []
    if pp == 1:
        return [
            f"strategy.megatron.virtual_pipeline ({vp}) needs pipeline_parallel > 1: model chunks "
            "interleave over pipeline stages; set virtual_pipeline to 1 or pipeline_parallel to 2 or more"
        ]
    if num_layers is not None and num_layers % (pp * vp):
        fits = [v for v in range(1, num_layers // pp + 1) if num_layers % (pp * v) == 0]
        return [
            f"strategy.megatron.pipeline_parallel ({pp}) x virtual_pipeline ({vp}) = {pp * vp} must divide "
            f"the model's {num_layers} layers (num_hidden_layers): each model chunk holds an equal share; "
            f"use a virtual_pipeline of {fits}" + ("" if fits else " or another pipeline_parallel")
        ]
    return []


def megatron_moe_problems(c: Any, m: MegatronConfig) -> list[str]:
    """What the Megatron strategy cannot do with the model of config ``c`` under ``m``'s sizes: pipeline
    stages (and their model chunks) need an even share of the layers, expert parallelism needs experts,
    and a mixture of experts at tensor_parallel > 1 needs sequence parallelism (Megatron-Core's MoE layer
    refuses to train without it)."""
    kind = getattr(c, "model_type", None)
    moe = kind == "qwen3_moe"
    experts = int(getattr(c, "num_experts", 0) or 0) if moe else 0  # 0 also where only the name is known
    problems = []
    layers = int(getattr(c, "num_hidden_layers", 0) or 0)
    vp = m.virtual_pipeline
    if layers and vp == 1 and not pipeline_stage_sizes(layers, m.pipeline_parallel):
        problems.append(pipeline_split_problem(layers, m.pipeline_parallel))
    if layers and m.pipeline_parallel > 1:  # at pipeline_parallel 1: megatron_parallel_problems'
        problems += virtual_pipeline_problems(layers, m.pipeline_parallel, vp)
    if m.expert_parallel > 1 and kind in MEGATRON_MODEL_TYPES and not moe:
        problems.append(
            f"strategy.megatron.expert_parallel={m.expert_parallel} needs a mixture-of-experts model; "
            f"model.path is a dense {c.model_type!r} model: set expert_parallel to 1"
        )
    if experts and experts % m.expert_parallel:
        problems.append(
            f"strategy.megatron.expert_parallel ({m.expert_parallel}) must divide the model's num_experts "
            f"({experts}): pick an expert_parallel that does"
        )
    if moe and m.tensor_parallel > 1 and not m.sequence_parallel:
        problems.append(
            f"strategy.megatron.tensor_parallel={m.tensor_parallel} with a mixture-of-experts model needs "
            "strategy.megatron.sequence_parallel=true (Megatron-Core trains a mixture of experts at "
            "tensor_parallel > 1 only with sequence parallelism): set sequence_parallel=true, or "
            "tensor_parallel=1 and spread the experts with expert_parallel"
        )
    return problems


# The roles whose ranks split sequences with strategy.context_parallel (TrainerGroup's): the policy's
# training and log-prob passes and the reference's; a critic, teacher or reward model keeps whole rows.
CONTEXT_PARALLEL_ROLES = ("actor_train", "reference")


def context_parallel_size(cfg: RunConfig, role: str) -> int:
    """The size of ``role``'s context-parallel groups: for the roles that split sequences
    (``CONTEXT_PARALLEL_ROLES``) ``strategy.megatron.context_parallel`` under megatron, else
    ``strategy.context_parallel``; 1 for the other roles."""
    if role not in CONTEXT_PARALLEL_ROLES:
        return 1
    if cfg.strategy.name == "megatron":
        return cfg.strategy.megatron.context_parallel
    return cfg.strategy.context_parallel


def context_parallel_stride(cfg: RunConfig, role: str) -> int:
    """How far apart the ranks of one of ``role``'s context-parallel groups are
    (``reroll.strategies.context_parallel.group_ranks``): megatron's ``tensor_parallel``, whose groups
    are consecutive ranks (a context-parallel group's ranks hold the same shard), else 1."""
    return cfg.strategy.megatron.tensor_parallel if cfg.strategy.name == "megatron" else 1


def data_parallel_size(cfg: RunConfig, role: str) -> int:
    """How many parts a batch is split into for ``role``: its ranks over its context-parallel size."""
    return max(getattr(cfg.roles, role).world_size // context_parallel_size(cfg, role), 1)


def context_parallel_strategy_problem(size: int, name: str) -> str:
    """Why ``strategy.context_parallel`` cannot run on strategy ``name``."""
    other = "; megatron has its own, strategy.megatron.context_parallel" if name == "megatron" else ""
    return (
        f"strategy.context_parallel={size} is built for strategy.name=fsdp2 (Ulysses sequence "
        f"parallelism), not {name}{other}: set strategy.name=fsdp2, or strategy.context_parallel=1"
    )


def ulysses_model_problems(c: Any, size: int) -> list[str]:
    """Why a model of Hugging Face config ``c`` (a ``PretrainedConfig``, or config.json's fields as
    attributes; its text part where it has one) cannot attend split over ``size`` ranks by Ulysses:
    each rank takes 1/size of the attention and of the key-value heads."""
    text = c.get_text_config() if hasattr(c, "get_text_config") else getattr(c, "text_config", None) or c
    if isinstance(text, dict):
        text = SimpleNamespace(**text)
    problems = [
        f"strategy.context_parallel={size} must divide the model's {name} ({n}): Ulysses gives each "
        f"rank of a group 1/{size} of the heads; use one of {fits}"
        for name, n, fits in _unsplit_heads(text, 1, size)
    ]
    windowed = getattr(text, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(text, "layer_types", None) or ()
    )
    if windowed or getattr(text, "attn_logit_softcapping", None) is not None:
        problems.append(
            f"strategy.context_parallel={size}: the model has sliding-window or soft-capped attention, which "
            "the Ulysses attention does not run; set strategy.context_parallel=1"
        )
    return problems


def context_parallel_problems(cfg: RunConfig, strategies: dict[str, str]) -> list[tuple[str, str]]:
    """What ``strategy.context_parallel`` cannot do in this run: ``strategies`` names each started
    trainer role's backend."""
    size = cfg.strategy.context_parallel
    if size == 1:
        return []
    problems = []
    for role in (r for r in CONTEXT_PARALLEL_ROLES if r in strategies):
        if strategies[role] != "fsdp2":
            problems.append(
                ("strategy.context_parallel", context_parallel_strategy_problem(size, strategies[role]))
            )
        world = getattr(cfg.roles, role).world_size
        if world % size:
            fits = ", ".join(str(size * k) for k in range(1, 4))
            problems.append(
                (
                    f"roles.{role}.world_size",
                    f"{world} is not a multiple of strategy.context_parallel ({size}): a role's ranks form "
                    f"groups of {size} that split each sequence; use {fits}, ... or another context_parallel",
                )
            )
    if cfg.policy_head != "causal_lm":
        problems.append(
            (
                "strategy.context_parallel",
                "a reward model (pipeline reward_model) pools each row to one score, which context "
                "parallelism does not split: set strategy.context_parallel=1",
            )
        )
    problems += [
        ("strategy.context_parallel", m) for m in ulysses_model_problems(_model_config(cfg.model.path), size)
    ]
    return problems


def megatron_model_problem(found: str | None) -> str | None:
    """Why the Megatron strategy cannot convert a model of type ``found`` (None: it can, or unknown)."""
    if found is None or found in MEGATRON_MODEL_TYPES:
        return None
    return (
        f"strategy.name=megatron converts {', '.join(MEGATRON_MODEL_TYPES)} models; model.path is a "
        f"{found!r} model: use strategy.name=fsdp2 for it"
    )


LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def megatron_model_problems(c: Any) -> list[str]:
    """What the Megatron conversion (``reroll.models.megatron_convert``) cannot take in the Hugging Face
    config ``c`` (a ``PretrainedConfig``, or config.json's fields as attributes)."""
    why = megatron_model_problem(getattr(c, "model_type", None))
    if why is not None:
        return [why]
    problems = []
    if c.model_type == "qwen3_moe" and (
        getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1
    ):
        problems.append(
            "strategy.name=megatron converts Qwen3-MoE models whose every layer is sparse "
            f"(decoder_sparse_step 1, no mlp_only_layers); this one has decoder_sparse_step "
            f"{getattr(c, 'decoder_sparse_step', 1)}, mlp_only_layers {getattr(c, 'mlp_only_layers', None)}"
        )
    if getattr(c, "use_sliding_window", False):
        problems.append(
            "strategy.name=megatron does not support sliding-window attention (use_sliding_window)"
        )
    if c.model_type == "llama" and (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)):
        problems.append("strategy.name=megatron supports Llama without attention_bias/mlp_bias only")
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        problems.append(f"strategy.name=megatron supports SwiGLU (hidden_act silu), not {act!r}")
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3" and any(float(rope.get(k, -1)) != v for k, v in LLAMA3_ROPE.items()):
        problems.append(
            f"llama3 rope scaling other than {LLAMA3_ROPE} is not supported by Megatron-Core: {rope}"
        )
    elif rope_type not in ("default", "llama3"):
        problems.append(f"strategy.name=megatron does not support rope_type {rope_type!r}")
    return problems


def _model_config(path: str) -> Any:
    """``model.path``'s config.json as attributes when it is a local directory, else an object with the
    known family's ``model_type`` and ``num_hidden_layers`` (None when neither tells)."""
    try:
        fields = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        if isinstance(fields, dict):
            return SimpleNamespace(**fields)
    except (OSError, ValueError):
        pass
    known = known_shape(path)  # a hub id of a known family: its layers too (pipeline stages)
    return SimpleNamespace(model_type=model_type(path), num_hidden_layers=known.layers if known else None)


def all_or_nothing_checkpointing(cfg: RunConfig, strategy: str) -> list[tuple[str, str]]:
    """A count of checkpointed layers or 'auto' under a strategy that checkpoints every layer or none."""
    setting = cfg.model.gradient_checkpointing
    if isinstance(setting, bool):
        return []
    return [
        (
            "model.gradient_checkpointing",
            f"model.gradient_checkpointing={setting!r} (a count of layers, or 'auto') is for the torch and "
            f"fsdp2 strategies; strategy.name={strategy} checkpoints every layer or none: set true or false, "
            "or strategy.name=fsdp2",
        )
    ]


def megatron_checkpointing_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """``model.gradient_checkpointing`` values Megatron does not take: 'auto' (chosen at a rank's first
    pass, where Megatron builds its recompute into the model), a count with pipeline parallel (Megatron's
    ``recompute_num_layers`` counts per pipeline stage)."""
    setting, path = cfg.model.gradient_checkpointing, "model.gradient_checkpointing"
    if setting == "auto":
        return [
            (
                path,
                "model.gradient_checkpointing='auto' chooses at a rank's first pass, but Megatron builds its "
                "recompute into the model: set a count of first layers (`reroll plan` with "
                "model.gradient_checkpointing=auto and strategy.name=fsdp2 prints the one 'auto' picks), true "
                "or false",
            )
        ]
    if not isinstance(setting, bool) and cfg.strategy.megatron.pipeline_parallel > 1:
        return [
            (
                path,
                f"model.gradient_checkpointing={setting} (a count of layers) with strategy.megatron."
                f"pipeline_parallel={cfg.strategy.megatron.pipeline_parallel}: Megatron counts recomputed "
                "layers per pipeline stage; set true or false, or pipeline_parallel=1",
            )
        ]
    return []


def megatron_moe_checkpointing_problem(c: Any, setting: bool | int | str) -> str | None:
    """A count of layers for a mixture of experts, which Megatron recomputes attention of only (true)."""
    if isinstance(setting, bool) or setting == "auto" or getattr(c, "model_type", None) != "qwen3_moe":
        return None
    return (
        f"model.gradient_checkpointing={setting} (a count of layers) with a mixture-of-experts model: "
        "Megatron recomputes a mixture of experts' attention only, in every layer (a full-layer recompute "
        "would lose the router's load-balancing loss); set true or false"
    )


def megatron_option_problems(cfg: RunConfig, head: str = "causal_lm") -> list[tuple[str, str]]:
    """Options the Megatron strategy does not take."""
    problems = megatron_checkpointing_problems(cfg)
    if head != "causal_lm":
        problems.append(
            (
                "critic",
                "strategy.name=megatron holds causal LMs only; the critic's value head needs "
                "strategy.name=fsdp2 or torch",
            )
        )
    problems += megatron_lora_problems(cfg)
    if cfg.model.dtype == "float16":
        problems.append(
            ("model.dtype", "strategy.name=megatron trains in bfloat16 or float32: set model.dtype=bfloat16")
        )
    return problems


# Hugging Face linear layers -> the Megatron layer that holds them (q, k, v fused; gate and up fused)
MEGATRON_LAYER = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}


def megatron_targets(target_modules: Sequence[str]) -> tuple[set[str], str | None]:
    """The Megatron layers ``strategy.lora.target_modules`` (Hugging Face names) adapt, and what is wrong
    with them: a name no Megatron layer holds, or part of a fused layer without the rest (one adapter on
    a fused layer adapts all of its parts)."""
    unknown = sorted(t for t in target_modules if t not in MEGATRON_LAYER)
    if unknown:
        return (
            set(),
            f"{unknown} are not layers of the Megatron strategy's models: choose from {sorted(MEGATRON_LAYER)}",
        )
    layers = {MEGATRON_LAYER[t] for t in target_modules}
    for layer in sorted(layers):
        parts = sorted(n for n, m in MEGATRON_LAYER.items() if m == layer)
        missing = [p for p in parts if p not in target_modules]
        if missing:
            named = sorted(set(parts) - set(missing))
            return layers, (
                f"Megatron computes {' + '.join(parts)} as one layer ({layer}) and adapts it whole: add "
                f"{missing}, or leave out {named}"
            )
    return layers, None


def megatron_lora_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What LoRA on the Megatron strategy does not take (``reroll.strategies.megatron_lora``)."""
    lora, m = cfg.strategy.lora, cfg.strategy.megatron
    if lora is None:
        return []
    problems = []
    if (problem := megatron_targets(lora.target_modules)[1]) is not None:
        problems.append(("strategy.lora.target_modules", problem))
    if lora.dropout > 0:
        problems.append(
            ("strategy.lora.dropout", "adapter dropout is not built for strategy.name=megatron: set it to 0")
        )
    if m.transformer_engine == "on":
        problems.append(
            (
                "strategy.megatron.transformer_engine",
                "LoRA adapts Megatron-Core's local layers (Transformer Engine fuses the norm into the "
                "linear layer the adapter needs the input of): set transformer_engine to auto or off",
            )
        )
    if m.distributed_optimizer and "distributed_optimizer" in m.model_fields_set:
        problems.append(
            (
                "strategy.megatron.distributed_optimizer",
                "with strategy.lora only the adapters train and their optimizer state stays whole on each "
                "rank (it is small): leave distributed_optimizer unset or set it to false",
            )
        )
    return problems


MEGATRON_MOE_LORA = (
    "LoRA on the megatron strategy adapts dense models (not a mixture of experts' experts): use "
    "strategy.name=fsdp2 for LoRA on this model, or train it in full"
)
MEGATRON_NEEDS_GPUS = (
    "strategy.name=megatron needs GPUs (Megatron-Core's forward runs on CUDA): give the role "
    "roles.<role>.num_gpus_per_worker > 0, or set strategy.name=fsdp2"
)


def deepspeed_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Options the DeepSpeed strategy does not take."""
    problems = all_or_nothing_checkpointing(cfg, "deepspeed")
    ds = cfg.strategy.deepspeed
    if ds.offload_params and ds.zero_stage != 3:
        problems.append(
            (
                "strategy.deepspeed.offload_params",
                "strategy.deepspeed.offload_params needs zero_stage 3 (ZeRO-2 does not shard parameters): "
                "set strategy.deepspeed.zero_stage=3 or offload_params=false",
            )
        )
    return problems


SLEEP_NEEDS_CUDA = (
    "{key} needs CUDA: the engine's CPU build has no sleep mode (vLLM: 'Sleep mode is not supported on "
    "current platform'); set it to false on CPU"
)
VLLM_SLEEP_NEEDS_CUDA = SLEEP_NEEDS_CUDA.format(key="rollout.vllm.enable_sleep_mode")


def start_problems(cfg: RunConfig, device_type: str | None = None) -> list[tuple[str, str]]:
    """Every reason the roles of ``cfg`` would be refused at start, as ``(dotted path, message)``.

    ``device_type``: what a pool device is ('cuda' or 'cpu'), or None where that is not known yet
    (``reroll validate`` without a cluster, a config with ``placement.device_type: auto``): the checks
    that depend on it are then left to the run, which calls this again once it knows."""
    if device_type is None and cfg.placement.device_type != "auto":
        device_type = cfg.placement.device_type
    problems = []
    specs = run_roles(cfg, device_type)
    trainers = [name for name, spec in specs.items() if spec.holds == "strategy"]
    devices = {r: role_device(cfg, r, device_type) if device_type else None for r in trainers}
    strategies = {r: specs[r].backend for r in trainers}
    megatron = [r for r in trainers if strategies[r] == "megatron"]
    if megatron:
        for role in megatron:
            size = getattr(cfg.roles, role).world_size
            problems += [
                ("strategy.megatron", m)
                for m in megatron_parallel_problems(
                    size, cfg.strategy.megatron, role, context_parallel_size(cfg, role)
                )
            ]
            if devices[role] == "cpu":
                problems.append((f"roles.{role}", MEGATRON_NEEDS_GPUS.replace("<role>", role)))
        problems += megatron_option_problems(cfg, "value" if "critic" in megatron else "causal_lm")
        model_config = _model_config(cfg.model.path)
        problems += [("model.path", m) for m in megatron_model_problems(model_config)]
        problems += [
            ("strategy.megatron", m) for m in megatron_moe_problems(model_config, cfg.strategy.megatron)
        ]
        if cfg.strategy.lora is not None and getattr(model_config, "model_type", None) == "qwen3_moe":
            problems.append(("strategy.lora", MEGATRON_MOE_LORA))
        split = max(context_parallel_size(cfg, role) for role in megatron)
        problems += [
            ("strategy.megatron.context_parallel", m)
            for m in megatron_context_parallel_problems(model_config, cfg.strategy.megatron, split)
        ]
        counted = megatron_moe_checkpointing_problem(model_config, cfg.model.gradient_checkpointing)
        problems += [("model.gradient_checkpointing", counted)] if counted else []
    if any(s == "deepspeed" for s in strategies.values()):
        problems += deepspeed_problems(cfg)
    problems += context_parallel_problems(cfg, strategies)
    compiled_elsewhere = sorted({s for s in strategies.values() if s not in ("torch", "auto")})
    if cfg.model.compile and compiled_elsewhere:
        problems.append(
            (
                "model.compile",
                f"model.compile is built for the torch strategy only, not {', '.join(compiled_elsewhere)}: "
                "set model.compile=false (or strategy.name=torch where the role has one rank)",
            )
        )
    if "actor_infer" in specs:
        problems += engine_problems(cfg, device_type)
    problems += vision_model_problems(cfg, model_type(cfg.model.path))
    return list(dict.fromkeys(problems))  # a problem of both megatron roles once


def engine_problems(cfg: RunConfig, device_type: str | None) -> list[tuple[str, str]]:
    """What actor_infer's engine cannot do that the config asks of it (its ``EngineSpec``)."""
    spec, r, problems = engine_spec(cfg.rollout.engine), cfg.rollout, []
    if cfg.strategy.synced_adapters is not None and not spec.lora:
        problems.append(
            (
                "strategy.lora.sync",
                f"'adapters', but the {spec.name} engine takes no LoRA adapters: set it to 'merged'",
            )
        )
    infer = role_device(cfg, "actor_infer", device_type) if device_type else None
    spanning = spec.span_problem(r, infer) if spec.span_problem is not None and infer else None
    problems += [spanning] if spanning else []
    modelled = spec.model_problem(r, _model_config(cfg.model.path)) if spec.model_problem else None
    problems += [modelled] if modelled else []
    switch = spec.sleep_switch(r) if spec.sleep_switch is not None else None
    if switch and spec.sleep_needs_cuda and infer == "cpu":
        problems.append((spec.sleep_switch_key, SLEEP_NEEDS_CUDA.format(key=spec.sleep_switch_key)))
    if (
        switch is False
        and infer == "cuda"
        and shares_device(cfg, "actor_infer", device_type)
        and offload_between_phases(cfg, "cuda")
    ):
        problems.append(
            (
                spec.sleep_switch_key,
                f"false, but actor_infer shares its GPU with another role and placement.offload="
                f"{cfg.placement.offload} frees it for them between phases, which the {spec.name} engine "
                f"does by sleeping: leave {spec.sleep_switch_key} unset (or true), or set "
                "placement.offload=never if everything fits on the GPU at once",
            )
        )
    return problems
