"""Memory arithmetic of a model's passes from its shape: what one token of a micro-batch holds at a
training pass's peak and at a forward-only pass's (``token_bytes``), and the size of the forward-only
passes that follows (``forward_only_limits``). ``reroll plan`` estimates a run from it; the trainers
size their forward-only passes on GPUs with it. A model's shape comes from its config.json, or from
the table of known families for a hub id (``known_shape``). No torch: the plan runs without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from reroll.config.placement import offload_between_phases

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model."""

    params: float  # total parameters (all experts of a MoE)
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int
    expert_params: float = 0.0  # the part of ``params`` in routed experts
    intermediate: int = 0  # MLP width a token passes through (MoE: its experts'); 0: 4 x hidden
    context: int = 0  # max_position_embeddings where the config says it (0: not known)

    @property
    def mlp(self) -> int:
        return self.intermediate or 4 * self.hidden


def token_shape(c: dict, *, params: float = 0.0, expert_params: float = 0.0) -> Shape:
    """The shape a Hugging Face ``config.json`` (as a dict) describes; ``params`` (which only the
    state's estimate needs) as given."""
    heads = c["num_attention_heads"]
    return Shape(
        params,
        c["num_hidden_layers"],
        c["hidden_size"],
        c.get("num_key_value_heads", heads),
        c.get("head_dim") or c["hidden_size"] // heads,
        c["vocab_size"],
        expert_params,
        _mlp_width(c),
        c.get("max_position_embeddings") or 0,
    )


def model_token_shape(path: str) -> Shape | None:
    """The per-token part of ``path``'s shape (a local model or one in the Hugging Face cache), from its
    config (a multimodal model's ``text_config``); None where the config does not say."""
    from transformers import AutoConfig

    try:
        c = AutoConfig.from_pretrained(path).to_dict()
        return token_shape(c if "num_hidden_layers" in c else c.get("text_config") or {})
    except (OSError, ValueError, KeyError):
        return None


def _mlp_width(c: dict) -> int:
    """The MLP width one token's activations have: a dense model's ``intermediate_size``; a MoE's routed
    experts a token (``num_experts_per_tok`` x ``moe_intermediate_size``) plus a shared expert's."""
    routed = c.get("num_experts_per_tok") and c.get("moe_intermediate_size")
    if routed:
        return int(
            c["num_experts_per_tok"] * c["moe_intermediate_size"]
            + c.get("shared_expert_intermediate_size", 0)
        )
    return int(c.get("intermediate_size") or 0)


@dataclass(frozen=True)
class TokenBytes:
    """Bytes one token of a micro-batch takes at a pass's peak, per model-parallel rank."""

    kept: float  # activations a training pass keeps for backward (all layers)
    layer: float  # one layer's activations: what a forward-only pass holds at once
    train_logits: float  # the head's output at response positions and its gradient
    scored_logits: float  # a forward-only pass's head output at response positions
    all_logits: float  # the head's output where a pass runs it at every position (a teacher's)

    def scored(self, every_position: bool) -> float:
        """A forward-only pass's head output: at every position (a teacher's) or at response positions."""
        return self.all_logits if every_position else self.scored_logits


def token_bytes(cfg: RunConfig, shape: Shape, seq: int, *, context_parallel: int = 1) -> TokenBytes:
    """``TokenBytes`` of a row of ``seq`` tokens whose last ``rollout.max_new_tokens`` (at most all) are
    the response; ``context_parallel``: the size of the role's groups that split each row (Ulysses, fsdp2's
    or megatron's: a rank holds 1/n of a row's activations and runs the head at 1/n of its positions)."""
    p_bytes = DTYPE_BYTES[cfg.compute_dtype]
    inside, outside = _layer_activations(cfg, shape, p_bytes)
    tp, sequence = 1, 1  # the TP ranks splitting the TP regions', the ranks splitting every activation
    pp, vp = 1, 1  # pipeline stages, model chunks a stage
    if cfg.strategy.name == "fsdp2":
        sequence = context_parallel
    if cfg.strategy.name == "megatron":
        m = cfg.strategy.megatron
        tp, sequence, pp, vp = m.tensor_parallel, context_parallel, m.pipeline_parallel, m.virtual_pipeline
    # under sequence parallelism a TP group's ranks split the activations outside attention and MLP (the
    # norms', the residual stream, a checkpointed layer's input) by sequence too; without it they are
    # replicated on each TP rank
    outside_tp = tp if cfg.strategy.name == "megatron" and cfg.strategy.megatron.sequence_parallel else 1
    layer = (inside / tp + outside / outside_tp) / sequence
    layer_input = shape.hidden * p_bytes / outside_tp / sequence
    checkpointed = checkpointed_layers(cfg.model.gradient_checkpointing, shape.layers)
    kept = kept_activations(shape.layers, checkpointed, layer=layer, layer_input=layer_input)
    # a pipeline stage runs the rows of its pipeline_parallel ranks through 1/pipeline_parallel of the
    # layers (reroll.strategies.megatron_pipeline): per rank, as many layer-rows as without stages; under
    # 1F1B (megatron_pipeline.run_schedule) the first stage holds the kept activations of up to
    # pipeline_parallel micro-batches at once (more when interleaved: ``pipeline_in_flight``), and the
    # last stage computes those rows' logits
    kept *= pipeline_in_flight(pp, vp)
    layer *= pp
    model_par, stage_rows = tp * sequence, pp
    # the head runs at the positions before response tokens alone: their logits in the compute dtype
    # (and their gradient when training); log-probs take fp32 chunks of them
    every = shape.vocab * p_bytes / model_par * stage_rows
    head = min(cfg.rollout.max_new_tokens / seq, 1.0) * every
    return TokenBytes(kept=kept, layer=layer, train_logits=2 * head, scored_logits=head, all_logits=every)


def pipeline_in_flight(pp: int, vp: int) -> float:
    """How many micro-batches' activations (in whole stages' worth) the first of ``pp`` pipeline stages
    holds at once: ``pp`` under 1F1B; the interleaved schedule over ``vp`` model chunks runs
    ``2 (pp - 1) + (vp - 1) pp`` chunk forwards before its first backward (Megatron-Core's warm-up, with
    groups of ``pp`` micro-batches a chunk: ``megatron_pipeline.interleaved_group``) and one more, each
    chunk ``1 / vp`` of the stage's layers. An upper bound: a step of fewer micro-batches holds fewer."""
    if vp == 1:
        return float(pp)
    return (2 * (pp - 1) + (vp - 1) * pp + 1) / vp


def checkpointed_layers(setting: bool | int | str, layers: int) -> int:
    """The decoder layers ``model.gradient_checkpointing`` checkpoints in a model of ``layers``: true all,
    false none, a count that many (at most all). 'auto' before a role has chosen its count (one that
    does not train, or a trainer before its first pass): all, the least its training passes can hold,
    which sizes its forward-only passes (``forward_only_limits``) no larger than the chosen count's."""
    if setting == "auto" or setting is True:
        return layers
    return min(int(setting), layers)


def kept_activations(layers: int, checkpointed: int, *, layer: float, layer_input: float) -> float:
    """Bytes a token's decoder layers hold at a training pass's peak when the first ``checkpointed`` of
    ``layers`` keep only their input (``layer_input``) and recompute the rest of their activations
    (``layer``, which includes the input) in backward, the others keep all of theirs:
    ``min(n, L - 1) * input + max(L - n, 1) * layer``.

    Why the first layers: backward runs from the last layer to the first, so by the time it reaches
    a checkpointed first layer every later layer has freed its activations, and the one layer being
    recomputed is the only full set alive beside the checkpointed inputs. The peak is at the start of
    backward (the uncheckpointed layers' full activations beside the checkpointed inputs), or, with
    every layer checkpointed, while the last layer is recomputed (its input is the stored one, not a
    second copy). Checkpointing the last N instead would recompute each of them while the first
    layers' activations are all still held: one layer's activations more at the peak for the same
    recompute time. So the estimate falls with each layer checkpointed, to its least at L - 1 (the
    last layer's recompute then saves nothing: it runs first in backward); 0 gives ``L * layer``."""
    n = min(max(checkpointed, 0), layers)
    return min(n, layers - 1) * layer_input + max(layers - n, 1) * layer


def forward_only_limits(
    cfg: RunConfig, shape: Shape | None, seq: int, *, every_position: bool = False
) -> tuple[int | None, int | None]:
    """``(rows, tokens)``, one of them None: the most a forward-only pass (reference and old log-probs,
    critic values) of a GPU run takes at once, for rows of ``seq`` tokens. The ``optim.logprob_*``
    settings where either is set. Else training's limit (``optim.micro_batch_size`` rows, or
    ``optim.max_tokens_per_micro_batch`` tokens) times the forward-only tokens that fit in the memory a
    training token takes at its peak: its activations kept for backward, the head's output and its
    gradient, against one layer's activations and the head's output (``TokenBytes``; at every position
    with ``every_position``, as a teacher runs it). Such a pass holds no more than a training
    micro-batch, in fewer, larger passes. Training's limit where colocated roles never offload
    (``placement.offload: never``: there every role keeps its passes' memory beside the others'), and
    without a ``shape`` (off GPUs, where memory does not bound them)."""
    o = cfg.optim
    if o.logprob_micro_batch_size or o.logprob_max_tokens_per_micro_batch:
        return o.logprob_micro_batch_size, o.logprob_max_tokens_per_micro_batch
    rows, tokens = (
        (None, o.max_tokens_per_micro_batch) if o.max_tokens_per_micro_batch else (o.micro_batch_size, None)
    )
    if shape is None or not offload_between_phases(cfg, "cuda"):
        return rows, tokens
    per = token_bytes(cfg, shape, seq)
    scale = max((per.kept + per.train_logits) / (per.layer + per.scored(every_position)), 1.0)
    return (None, int(tokens * scale)) if tokens else (int(rows * scale), None)


def _layer_activations(cfg: RunConfig, shape: Shape, p_bytes: int) -> tuple[float, float]:
    """Bytes a token leaves in one decoder layer for the backward pass of a Hugging Face model, as
    ``(inside, outside)`` the tensor-parallel regions: inside, the MLP's four tensors of its width (gate,
    up, the activation, their product) and attention's four of the hidden size (queries, keys, values,
    its output before the projection); outside, five of the hidden size (the two norms' inputs and
    outputs, the residual stream), four more where the RMSNorm layers run the model's own fp32 code
    (``model.fused_norm: false``). Calibrated on one measurement: the Qwen2.5-0.5B shape's training pass
    at 64 rows of 384 tokens in bf16 peaked at 41.6 GiB (45.6 GiB with the model's own norms) on an H100
    (docs/benchmarks.md, run K); the estimate: 41.3 (45.3)."""
    outside = 5 if cfg.model.fused_norm else 9
    return p_bytes * (4 * shape.hidden + 4 * shape.mlp), p_bytes * outside * shape.hidden


# Published shapes of the model families the example configs use (parameters from the model cards).
KNOWN = {
    "qwen2.5-0.5b": Shape(0.494e9, 24, 896, 2, 64, 151936, intermediate=4864),
    "qwen2.5-1.5b": Shape(1.54e9, 28, 1536, 2, 128, 151936, intermediate=8960),
    "qwen2.5-3b": Shape(3.09e9, 36, 2048, 2, 128, 151936, intermediate=11008),
    "qwen2.5-7b": Shape(7.62e9, 28, 3584, 4, 128, 152064, intermediate=18944),
    "qwen2.5-14b": Shape(14.7e9, 48, 5120, 8, 128, 152064, intermediate=13824),
    "qwen2.5-32b": Shape(32.5e9, 64, 5120, 8, 128, 152064, intermediate=27648),
    "qwen2.5-72b": Shape(72.7e9, 80, 8192, 8, 128, 152064, intermediate=29568),
    # vision-language: the vision tower's parameters (0.67B) counted with the rest
    "qwen2.5-vl-3b": Shape(3.75e9, 36, 2048, 2, 128, 151936, intermediate=11008),
    "qwen2.5-vl-7b": Shape(8.29e9, 28, 3584, 4, 128, 152064, intermediate=18944),
    "qwen3-8b": Shape(8.19e9, 36, 4096, 8, 128, 151936, intermediate=12288),
    # MoE: 8 routed experts a token of 768 / 1536 each
    "qwen3-30b-a3b": Shape(30.5e9, 48, 2048, 4, 128, 151936, expert_params=28.9e9, intermediate=6144),
    "qwen3-235b-a22b": Shape(235e9, 94, 4096, 4, 128, 151936, expert_params=226e9, intermediate=12288),
}


def known_shape(path: str) -> Shape | None:
    """The shape of the known family whose name ``path``'s last part starts with (the longest), or None."""
    name = path.lower().rsplit("/", 1)[-1]
    for key in sorted(KNOWN, key=len, reverse=True):
        if name.startswith(key):
            return KNOWN[key]
    return None
