"""The Megatron-Core strategy: a ``GPTModel`` split by tensor and pipeline parallelism, a mixture of
experts' experts spread by expert parallelism, gradients summed over data parallelism.

The role's ``world_size`` ranks are ``tensor_parallel x pipeline_parallel x context_parallel x
data_parallel``. Context parallelism splits every row's tokens over groups of ``context_parallel`` ranks,
attention by Ulysses all-to-alls in the core attention, without Transformer Engine
(``reroll.strategies.megatron_context``); Megatron-Core's own context-parallel size stays 1, so its
data-parallel ranks include the context-parallel ones and its DDP sums their gradients. Pipeline
stages hold consecutive layers (split as Megatron-Core splits them) and run a step's micro-batches by
Megatron-Core's 1F1B schedule (``train_micro_batches``; ``reroll.strategies.megatron_pipeline``), or
``virtual_pipeline`` model chunks each, interleaved by its schedule (``chunks``: a ``GPTModel`` each).
Sequence parallelism runs on Transformer Engine's layer spec or on Megatron-Core's local one, whose norms
take a rank's slice of the sequence (``reroll.strategies.megatron_spec``); with context parallelism a
rank's columns are scattered again over its TP ranks, rows padded to a multiple of ``context_parallel x
tensor_parallel`` (``_padded``). A Qwen3-MoE (on pipeline
stages too, and their model chunks under a virtual pipeline; at tensor_parallel > 1 with sequence
parallelism, its experts split over the TP ranks as the dense MLP) spreads its experts over groups of
``expert_parallel`` of the data-parallel ranks (Megatron-Core's expert-model-parallel groups); tokens go
to their experts' rank by all-to-all, and the trainer adds the router's load-balancing loss from the
logits ``moe_routers`` records (``reroll.strategies.megatron_moe``). Weights come from the Hugging Face
checkpoint through ``reroll.models.megatron_convert``, each rank reading from the safetensors files only
the tensors it holds (``reroll.models.checkpoint_reader``), and go back in Hugging Face names for weight
sync and export, one layer at a time (``reroll.strategies.megatron_weights``); the export's files are
written by every rank, each its share (``reroll.strategies.hf_export``). With ``strategy.lora`` only
adapters on the tensor-parallel linear layers train, split as the layers are, and the weights leave
merged (``reroll.strategies.megatron_lora``).

The role splits a batch by rows across its ranks, as for the other strategies (the ranks of a
context-parallel group get the same rows: ``reroll.config.startable.context_parallel_stride``). Tensor
parallelism needs the same rows on the ranks of one TP group, so ``logits`` gathers the group's rows,
runs them together and hands each rank back its own rows; the backward of that hand-back sums the
logits' gradients over the TP group, so every rank's weight shard gets the gradient of the group's
summed loss. Data-parallel gradients are then *summed* (``calculate_per_token_loss``: losses arrive
normalised by the whole step's token counts). The optimizer is Megatron-Core's (its
``DistributedOptimizer`` when ``strategy.megatron.distributed_optimizer``), Adam with decoupled weight
decay on every parameter (as ``torch.optim.AdamW``) and fp32 main weights for bf16 models; the lr
follows our linear warm-up. Every rank of a TP x PP group must make the same ``logits``/``backward`` calls.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from reroll.config.startable import (
    MEGATRON_MOE_LORA,
    MEGATRON_NEEDS_GPUS,
    megatron_context_parallel_problems,
    megatron_moe_checkpointing_problem,
    megatron_moe_problems,
    megatron_option_problems,
    megatron_parallel_problems,
)
from reroll.errors import UserError
from reroll.models import megatron_convert as mc
from reroll.models.checkpoint_reader import CheckpointReader, checkpoint_files
from reroll.models.loading import DTYPES, load_causal_lm
from reroll.packages import importable
from reroll.strategies import Head, megatron_lora
from reroll.strategies import megatron_optimizer_state as optimizer_state
from reroll.strategies.context_parallel import ContextParallel, split_columns
from reroll.strategies.hf_export import (
    HFNames,
    StreamGather,
    decoder_layers,
    distinct_state,
    layer_units,
    write_hf_model,
)
from reroll.strategies.host_parking import HostParking
from reroll.strategies.lora import AdapterUpdate, lora_config_dict, save_adapter
from reroll.strategies.megatron_moe import (
    MegatronRouters,
    RowSplit,
    allow_routers_without_transformer_engine,
)
from reroll.strategies.megatron_pipeline import Handed, Pipeline
from reroll.strategies.megatron_weights import Groups, hf_weights
from reroll.strategies.micro_batches import MicroBatchLoop
from reroll.strategies.training import warmup_factor

if TYPE_CHECKING:
    from reroll.config.schema import RunConfig
    from reroll.config.training import MegatronConfig
    from reroll.strategies.megatron_moe import ScheduledRouting
    from reroll.strategies.megatron_pipeline import GroupRows
    from reroll.strategies.micro_batches import MB, Record, RouterLoss

log = logging.getLogger(__name__)


def check_parallel_sizes(world_size: int, m: MegatronConfig, context_parallel: int = 1) -> int:
    """The data-parallel size of ``world_size`` ranks under ``m``'s model-parallel sizes and
    ``context_parallel`` (the role's); a ``UserError`` if they do not fit or ask for what this strategy
    cannot do yet (``reroll.config.startable``, the check ``reroll validate`` and ``reroll plan`` run)."""
    problems = megatron_parallel_problems(world_size, m, context_parallel=context_parallel)
    if problems:
        raise UserError("; ".join(problems))
    return world_size // (m.tensor_parallel * m.pipeline_parallel * context_parallel)


def use_transformer_engine(setting: str) -> bool:
    """Whether to build the Transformer Engine layer spec for ``strategy.megatron.transformer_engine``."""
    installed = importable("transformer_engine")
    if setting == "on" and not installed:
        raise UserError(
            "strategy.megatron.transformer_engine=on but transformer_engine is not installed: install it, "
            "or set transformer_engine=auto/off for Megatron-Core's local layer spec"
        )
    return installed and setting != "off"


def _check_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise UserError(MEGATRON_NEEDS_GPUS)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _gather_rows(
    ids: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """All rows of the ranks in ``group``, right-padded to one width: ``(ids, mask, rows of each group
    rank)``."""
    size = dist.get_world_size(group)
    shape = torch.tensor(ids.shape, device=ids.device)
    shapes = [torch.empty_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape, group=group)
    rows = [int(s[0]) for s in shapes]
    width = max(int(s[1]) for s in shapes)

    def gather(x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(max(rows), width)
        padded[: x.shape[0], : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, rows)])

    return gather(ids), gather(mask), rows


class MegatronStrategy(MicroBatchLoop):
    """Holds a Megatron-Core ``GPTModel`` (this rank's shard), its optimizer and warm-up.

    Built in the constructor for one rank, else in ``init_distributed`` (Megatron needs its process
    groups before the model). ``head`` must be ``"causal_lm"``: critics need another strategy.
    """

    fused_head = False  # its output layer is split over the TP ranks' vocabulary shards

    def __init__(
        self,
        model_path: str,
        *,
        cfg: RunConfig,
        device: str = "cuda",
        trainable: bool = True,
        rank: int = 0,
        world_size: int = 1,
        head: Head = "causal_lm",
        context_parallel: int | None = None,
    ) -> None:
        """``context_parallel``: the size of the groups that split each row (the role's,
        ``reroll.config.startable.context_parallel_size``; None: ``strategy.megatron.context_parallel``)."""
        problems = megatron_option_problems(cfg, head)
        if problems:
            raise UserError("; ".join(message for _, message in problems))
        self.device = torch.device(device)
        _check_device(self.device)
        self.mcfg = cfg.strategy.megatron
        self.cp = self.mcfg.context_parallel if context_parallel is None else context_parallel
        self.dp = check_parallel_sizes(world_size, self.mcfg, self.cp)
        self.tp, self.ep = self.mcfg.tensor_parallel, self.mcfg.expert_parallel
        self.pp, self.vp = self.mcfg.pipeline_parallel, self.mcfg.virtual_pipeline
        self.model_path, self.dtype, self.seed = model_path, cfg.model.dtype, cfg.seed
        self.trainable, self.rank, self.world_size = trainable, rank, world_size
        self.lora = cfg.strategy.lora if trainable else None  # adapters on the policy (megatron_lora)
        self.sharded_optimizer = self.mcfg.distributed_optimizer and self.lora is None
        # model.gradient_checkpointing: True every layer, a count the first that many (block), 0 / False none
        setting = cfg.model.gradient_checkpointing if trainable else False
        self.recompute: bool | int = setting if isinstance(setting, bool) else int(setting)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.shape = mc.gpt_shape(self.hf_config)
        moe_problems = megatron_moe_problems(self.hf_config, self.mcfg)
        moe_problems += megatron_context_parallel_problems(self.hf_config, self.mcfg, self.cp)
        counted = megatron_moe_checkpointing_problem(self.hf_config, self.recompute)
        moe_problems += [counted] if counted else []
        if not isinstance(self.recompute, bool) and self.recompute > self.shape.num_layers:
            moe_problems.append(
                f"model.gradient_checkpointing is {self.recompute}, but the model has {self.shape.num_layers} "
                f"decoder layers: set at most {self.shape.num_layers} (or true for all)"
            )
        if self.lora is not None and self.shape.num_experts:
            moe_problems.append(MEGATRON_MOE_LORA)
        if moe_problems:
            raise UserError("; ".join(moe_problems))
        # adapters sit on the local spec's linear layers (Transformer Engine fuses the norm into them)
        self.te = self.lora is None and use_transformer_engine(self.mcfg.transformer_engine)
        # the GPTModel of each model chunk (one but under a virtual pipeline) and what runs each: DDP-wrapped
        # when trainable; ``module`` and ``model`` are the one chunk's, or a ModuleList of the chunks'
        self.chunks: list[torch.nn.Module] = []
        self.models: list[torch.nn.Module] = []
        self.module: torch.nn.Module | None = None
        self.moe_routers: MegatronRouters | None = None  # a trainable mixture of experts' routers
        self.model: torch.nn.Module | None = None
        self.pipe: Pipeline | None = None  # this rank's pipeline stage (pipeline_parallel > 1)
        self.context_parallel: ContextParallel | None = None  # this rank's group (context_parallel > 1)
        # the ranks whose routers each see a slice of a row's tokens under context and sequence parallelism
        self.column_group: dist.ProcessGroup | None = None
        # inside a scheduled micro-batch's loss (run_schedule): what ``logits`` returns for its rows
        self._handed: Handed | None = None  # a scheduled loss's logits (megatron_pipeline.run_schedule)
        self.optimizer = None
        self._restore: list[Callable[[], None]] = []  # what reload runs after offload
        self._parked = HostParking()  # page-locked host buffers of the optimizer's storages, kept
        self.lr = self.weight_decay = 0.0
        self.warmup = self.steps = 0
        if world_size == 1:
            self._build(None)

    # -- setup -----------------------------------------------------------------------------------

    def init_distributed(self, address: str) -> None:
        """Join the role's ranks at ``tcp://address``, set up Megatron's groups and build the model."""
        if self.module is None:
            self._build(f"tcp://{address}")

    def _init_groups(self, init_method: str | None) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            if init_method is None:  # one rank: an in-process store
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            else:
                dist.init_process_group(
                    backend, init_method=init_method, rank=self.rank, world_size=self.world_size
                )
        if dist.get_world_size() != self.world_size:
            raise UserError(
                f"this process already belongs to a process group of {dist.get_world_size()} ranks, but the "
                f"megatron role has world_size {self.world_size}: give roles sharing a process one size"
            )
        if ps.model_parallel_is_initialized():
            sizes = (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            )
            if sizes != (self.tp, self.pp, self.ep, self.vp):
                raise UserError(
                    "roles sharing a process must use the same strategy.megatron tensor_parallel, "
                    "pipeline_parallel, expert_parallel and virtual_pipeline"
                )
            return
        # expert parallelism: groups of `ep` of the data-parallel ranks hold different experts; a virtual
        # pipeline's size picks the interleaved schedule (``get_forward_backward_func``)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vp if self.vp > 1 else None,
            expert_model_parallel_size=self.ep,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(self.seed)

    def _group_width(self, width: int) -> int:
        """The widest of the rows of this rank's tensor-parallel group (model-parallel with pipeline
        stages): the width ``logits`` runs them at, so the width every rank's columns are split at."""
        most = torch.tensor([width], device=self.device)
        dist.all_reduce(
            most, op=dist.ReduceOp.MAX, group=self.tp_group if self.pipe is None else self.mp_group
        )
        return int(most)

    def _split_width(self, width: int) -> int:
        """The width a context-parallel group splits rows of ``width`` tokens at (a collective): its
        tensor-parallel group's widest (``_group_width``), under sequence parallelism padded to a multiple
        of ``context_parallel x tensor_parallel``, so that each rank's columns scatter evenly over its TP
        ranks (``_padded``). Inside a scheduled loss, where only the last stage runs, the width of the
        group's rows it was handed (gathered at the widest: what the collective would find)."""
        if self._handed is not None:
            return self._padded(self._handed.rows.shape[1])
        return self._padded(self._group_width(width))

    def _padded(self, width: int) -> int:
        """``width`` rounded up to a multiple of the ranks that split a row's tokens: ``tensor_parallel``
        under sequence parallelism (Megatron scatters the sequence over them), times ``context_parallel``
        (each of its ranks' columns scattered so)."""
        if not self._sequence_parallel():
            return width
        split = self.tp * self.cp
        return -(-width // split) * split

    def _build(self, init_method: str | None) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel

        from reroll.strategies.megatron_context import chunk_rotary, join_column_groups, join_groups

        self._init_groups(init_method)
        if self.cp > 1:  # under TP or PP a group's rows run at the widest one's width
            widths = self._split_width if self.tp * self.pp > 1 else None
            self.context_parallel = join_groups(self.world_size, self.rank, self.cp, self.tp, widths)
        if self.cp > 1 and self._sequence_parallel():  # a row's columns, split by CP then by SP
            self.column_group = join_column_groups(self.world_size, self.rank, self.cp * self.tp)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.ep_group = ps.get_expert_model_parallel_group() if self.ep > 1 else None
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.mp_group = ps.get_model_parallel_group()  # tp x pp: the ranks that run their rows together
        dtype = DTYPES[self.dtype]
        if self.pp > 1:
            self.pipe = Pipeline(
                stage=ps.get_pipeline_model_parallel_rank(),
                ranks=tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())),
                group=ps.get_pipeline_model_parallel_group(),
                tp_group=self.tp_group if self.tp > 1 else None,
            )
        recompute = {}
        if self.recompute is True and self.shape.num_experts:
            # a full-layer recompute runs the router under no_grad, and its load-balancing loss would
            # reach no weight: a mixture of experts recomputes attention only
            recompute = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
        elif self.recompute is True:
            recompute = {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
        elif self.recompute:  # the first N layers (of the one pipeline stage: a count refuses pp > 1)
            recompute = {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": self.recompute,
            }
        config = mc.transformer_config(
            self.shape,
            ep=self.ep,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            pipeline_dtype=dtype,
            **mc.pipeline_config(self.shape.num_layers, self.pp, self.vp),
            expert_model_parallel_size=self.ep,
            sequence_parallel=self._sequence_parallel(),
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            calculate_per_token_loss=True,  # data-parallel gradients are summed, not averaged
            use_cpu_initialization=self.device.type == "cpu",
            # perform_initialization stays on: besides the random init (overwritten by the checkpoint
            # next), it marks the TP-split parameters, which the gradient norm needs
            **recompute,
        )
        if self.shape.num_experts:
            allow_routers_without_transformer_engine()
        stage = self.pipe.stage if self.pipe is not None else 0
        # one model chunk, or a virtual pipeline's: stage 0's first embeds, the last stage's last has the head
        for chunk in range(self.vp):
            module = GPTModel(
                config,
                self._layer_spec(config),
                parallel_output=False,
                pre_process=stage == 0 and chunk == 0,
                post_process=stage == self.pp - 1 and chunk == self.vp - 1,
                vp_stage=chunk if self.vp > 1 else None,
                **mc.gpt_model_kwargs(self.shape, self.tp),
            )
            # The local spec's norms (torch.nn.RMSNorm's) are built on the CPU in fp32 whatever the config
            # says; Megatron's own training casts the whole module (Float16Module), so do we.
            module.to(device=self.device, dtype=dtype)
            if self.context_parallel is not None:
                chunk_rotary(module, self.context_parallel)
            self.chunks.append(module)
        self._load_hf(self.model_path)
        for module in self.chunks:
            module.requires_grad_(self.trainable)
            module.train(self.trainable)
        if self.lora is not None:  # before DDP: its buffers hold the adapters alone
            megatron_lora.add_adapters(self.chunks, self.lora, self.tp_rank, self.tp)
        if self.shape.num_experts and self.trainable:  # every model chunk's routers
            chunks = torch.nn.ModuleList(self.chunks)
            self.moe_routers = MegatronRouters(chunks, self.shape, self.hf_config, self._row_split())
        self.models = list(self.chunks)
        if self.trainable:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

            ddp = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=self.sharded_optimizer
            )
            self.models = [
                DistributedDataParallel(config=config, ddp_config=ddp, module=m) for m in self.chunks
            ]
        one = len(self.chunks) == 1
        self.module = self.chunks[0] if one else torch.nn.ModuleList(self.chunks)
        self.model = self.models[0] if one else torch.nn.ModuleList(self.models)
        log.info(
            "megatron: %s layers, TP %d x PP %d (VP %d) x CP %d x DP %d (EP %d), %s spec, rank %d",
            self.shape.num_layers, self.tp, self.pp, self.vp, self.cp, self.dp, self.ep,
            "transformer_engine" if self.te else "local", self.rank,
        )  # fmt: skip

    def _layer_spec(self, config: Any) -> Any:
        """Transformer Engine's layer spec, or the local spec with norms that take sequence-parallel
        inputs (``reroll.strategies.megatron_spec``); with context parallelism, Ulysses core attention."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        from reroll.strategies.megatron_context import with_ulysses_attention
        from reroll.strategies.megatron_spec import local_block_spec

        experts, qk_norm = self.shape.num_experts, self.shape.qk_norm
        if self.te:
            spec = layer = get_gpt_layer_with_transformer_engine_spec(
                num_experts=experts or None, moe_grouped_gemm=False, qk_layernorm=qk_norm
            )
        else:
            spec = local_block_spec(config, num_experts=experts, qk_norm=qk_norm)
            layer = spec.layer_specs[0]  # shared by every layer
        if self.context_parallel is not None:
            with_ulysses_attention(layer, self.context_parallel)
        return spec

    def _load_hf(self, path: str | Path) -> None:
        """This rank's stage, experts and TP shard of the Hugging Face weights at ``path`` into each model
        chunk's ``GPTModel``: read from the safetensors files tensor by tensor, only those the rank holds
        (``mc.rank_from_hf``); a checkpoint without safetensors files (``.bin``), or whose files name
        weights otherwise than the conversion expects, is read whole through transformers."""
        for module, share in zip(self.chunks, self._shares(), strict=True):
            self._load_chunk(path, module, share)

    def _load_chunk(
        self,
        path: str | Path,
        module: torch.nn.Module,
        share: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]],
    ) -> None:
        """``_load_hf`` of one model chunk, ``share`` picking its tensors."""
        files = checkpoint_files(path)
        ours = None
        if files is None:
            log.info("megatron: %s has no safetensors files: rank %d reads the whole model", path, self.rank)
        else:
            with CheckpointReader(files, DTYPES[self.dtype]) as reader:
                try:
                    ours = share(reader)
                except KeyError as e:
                    log.warning(
                        "megatron: %s's safetensors files lack %s: rank %d reads the whole model through "
                        "transformers", path, e, self.rank,
                    )  # fmt: skip
            if ours is not None:
                log.info("megatron: rank %d read %.2f GB of %s", self.rank, reader.read_bytes / 1e9, path)
        if ours is None:
            ours = share(load_causal_lm(path, self.dtype, "cpu").state_dict())
        with torch.no_grad():
            result = module.load_state_dict(ours, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"converted weights do not fit the GPTModel: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )

    def _shares(self) -> list[Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]]:
        """What each model chunk of this rank holds of a checkpoint's tensors (``mc.rank_from_hf`` at its
        layout), in chunk order."""
        stage = self.pipe.stage if self.pipe is not None else 0
        layout = dict(
            s=self.shape, stage=stage, pp=self.pp, vp=self.vp, tp_rank=self.tp_rank, tp=self.tp,
            ep_rank=self.ep_rank, ep=self.ep, fused_norms=self.te,
        )  # fmt: skip
        return [partial(mc.rank_from_hf, chunk=chunk, **layout) for chunk in range(self.vp)]

    def _require(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("MegatronStrategy: call init_distributed first (the model is built there)")
        return self.model

    # -- training --------------------------------------------------------------------------------

    def configure_optimizer(
        self, *, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int
    ) -> None:
        """Megatron-Core's Adam (decoupled weight decay on every parameter), linear warm-up to ``lr``."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self._require()
        opt = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=1e-8,
            bf16=DTYPES[self.dtype] == torch.bfloat16,
            params_dtype=DTYPES[self.dtype],
            use_distributed_optimizer=self.sharded_optimizer,
            clip_grad=0.0,  # step() clips
        )
        # config_overrides={}: no parameter is exempt from weight decay (Megatron's default exempts 1-D)
        self.optimizer = get_megatron_optimizer(opt, self.models, config_overrides={})
        for model in self.models:
            model.zero_grad_buffer()
        self.lr, self.weight_decay, self.warmup, self.steps = lr, weight_decay, max(warmup_steps, 0), 0

    def logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        images: Any = None,
    ) -> torch.Tensor:
        """``(B, T, V)`` logits of right-padded rows, gathered over the TP ranks' vocabulary shards; with
        context parallelism every rank of a group passes the same rows and gets its columns' ``(B, w, V)``
        (``ContextParallel.columns``), which the caller gathers or combines."""
        model = self._require()
        if self._handed is not None:  # a scheduled step's loss: the last stage's logits of these rows
            return self._handed(input_ids)
        if images is not None:
            raise UserError(
                "the megatron strategy converts text models only: rows with images need fsdp2 or torch"
            )
        if attention_mask is None:
            raise UserError(
                "the megatron strategy takes right-padded rows with an attention_mask, not packed rows"
            )
        ids, mask = self._right_padded(input_ids, attention_mask)
        rows, width = ids.shape
        offset, rows_of = 0, [rows]
        if self.tp * self.pp > 1:  # the group's ranks run their rows together
            group = self.tp_group if self.pipe is None else self.mp_group
            ids, mask, rows_of = _gather_rows(ids, mask, group)
            offset = sum(rows_of[: dist.get_rank(group)])
        ids, positions, causal, t = self._model_inputs(ids)
        spans = None if self.pipe is None else self._spans(rows_of)
        if self.moe_routers is not None:
            self._start_routing(mask, ids.shape[1], rows_of)
        width = t if self.context_parallel is not None else width  # this rank's columns, all returned
        if self.pipe is not None:
            return self._pipelined(ids, positions, causal, spans, t)[:, :width]
        out = model(ids, positions, causal)[:, :t, : self.shape.vocab_size]
        if self.tp > 1:
            out = _SumGradOverGroup.apply(out, self.tp_group)[offset : offset + rows, :width]
        return out

    def _right_padded(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows and their mask on this rank's device; a ``UserError`` unless every row is right-padded
        (real tokens first, then padding), the only rows the model's inputs are built for."""
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device).long()
        right_padded = torch.arange(ids.shape[1], device=mask.device) < mask.sum(-1, keepdim=True)
        if not torch.equal(right_padded, mask.bool()):
            raise UserError("the megatron strategy needs right-padded rows (real tokens first, then padding)")
        return ids, mask

    def _sequence_parallel(self) -> bool:
        """Whether the model's activations outside attention and MLP are split over the TP ranks by
        sequence (``strategy.megatron.sequence_parallel`` at tensor_parallel > 1)."""
        return self.mcfg.sequence_parallel and self.tp > 1

    def _row_split(self) -> RowSplit | None:
        """How the rows this rank's routers see are split (``megatron_moe.RowSplit``): the group whose
        ranks' rows run together (``logits``'), the pipeline stages' layers, and a row's tokens over the TP
        ranks under sequence parallelism, over a context-parallel group, or over both (``column_group``);
        None where a rank routes every token of its own rows through every layer."""
        columns = self.column_group  # context and sequence parallel: a CP group's ranks with their TP ranks
        if columns is None and self.context_parallel is not None:
            columns = self.context_parallel.group
        elif columns is None and self._sequence_parallel():
            columns = self.tp_group
        if self.tp * self.pp == 1:
            return None if columns is None else RowSplit(None, 0, columns=columns)  # one member
        members = self.tp_group if self.pipe is None else self.mp_group
        return RowSplit(members, dist.get_rank(members), pipe=self.pipe, columns=columns)

    def _start_routing(self, mask: torch.Tensor, width: int, rows_of: list[int]) -> None:
        """Tell the routers a forward begins: the real tokens of the columns this rank routes (of the
        ``(rows, T)`` ``mask`` of the rows run; ``width``: the columns the model runs), and each member's
        rows (``rows_of``: each rank's of the group that ran them together, in its rank order)."""
        start, stop = 0, width
        if self.context_parallel is not None:
            whole = self._padded(mask.shape[1])
            start, stop = split_columns(whole, self.context_parallel.size, self.context_parallel.rank)
            width = self.context_parallel.size * (stop - start)
        if self._sequence_parallel():  # Megatron scatters the columns run over the TP ranks in rank order
            chunk = (stop - start) // self.tp
            start, stop = start + self.tp_rank * chunk, start + (self.tp_rank + 1) * chunk
        real = torch.nn.functional.pad(mask, (0, width - mask.shape[1]))[:, start:stop]
        self.moe_routers.start_forward(real, [(sum(rows_of[:m]), n) for m, n in enumerate(rows_of)])

    def _model_inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """What the ``GPTModel`` runs for the rows ``ids``: the token ids (padded for sequence parallelism;
        with context parallelism this rank's columns, ``megatron_context.columns_of``), their positions,
        the local spec's causal mask (built here on the right device; TE builds its own, but the Ulysses
        attention is the local spec's: the whole sequence's) and how many of the output's columns are
        the rows' (``t``)."""
        from reroll.strategies.megatron_context import causal_mask, columns_of

        t = ids.shape[1]
        ids = torch.nn.functional.pad(ids, (0, self._padded(t) - t))  # the sequence splits evenly
        if self.context_parallel is not None:
            return columns_of(ids, self.context_parallel)
        causal = None if self.te else causal_mask(ids.shape[1], ids.device)
        return ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), causal, t

    def _pipelined(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        causal: torch.Tensor | None,
        spans: list[tuple[int, int]],
        t: int,
    ) -> torch.Tensor:
        """This rank's rows' ``(rows, t, V)`` logits of the model-parallel group's rows ``ids`` (``spans``:
        each stage's rank's ``(first row, rows)``), through this rank's stage
        (``reroll.strategies.megatron_pipeline``): one micro-batch, unscheduled. With a virtual pipeline
        it runs each of the stage's chunks in turn, every chunk but the last handing its output on
        (``Pipeline.pass_on``: the last stage's to the first, where the next chunk starts): rows cross
        the stages ``virtual_pipeline`` times, as under the interleaved schedule."""
        pipe, dtype, vocab = self.pipe, DTYPES[self.dtype], self.shape.vocab_size
        assert pipe is not None
        shape = self._hidden_shape(ids)
        self._require()
        x = None if pipe.first else pipe.receive(shape, dtype, self.device)
        for chunk in range(self.vp):
            if x is not None:
                self.chunks[chunk].set_input_tensor(x)
            out = self.models[chunk](ids, positions, causal)
            if chunk < self.vp - 1:
                x = pipe.pass_on(out, shape, dtype)
        if pipe.last:
            out = out[:, :t, :vocab].to(dtype)
        return pipe.output(out, spans, (t, vocab), dtype)

    def _spans(self, rows_of: list[int]) -> list[tuple[int, int]]:
        """The ``(first row, rows)`` of each stage's rank of this rank's pipeline group among the
        model-parallel group's gathered rows (``rows_of``: each group rank's count)."""
        assert self.pipe is not None
        spans = []
        for rank in self.pipe.ranks:
            member = dist.get_group_rank(self.mp_group, rank)
            spans.append((sum(rows_of[:member]), rows_of[member]))
        return spans

    def backward(self, loss: torch.Tensor) -> None:
        if self.optimizer is None:
            raise RuntimeError("MegatronStrategy.backward: configure_optimizer first")
        loss.backward()

    def train_micro_batches(
        self,
        batches: Sequence[MB],
        loss_of: Callable[[MB], tuple[torch.Tensor, Record]],
        router: RouterLoss | None = None,
    ) -> list[Record]:
        """Pipeline stages run a step's micro-batches by a 1F1B schedule where they can
        (``_schedules``), the last stage computing every rank's loss, each stage (each of its model
        chunks) adding its routers' part of a mixture of experts' ``router`` term
        (``megatron_moe.ScheduledRouting``); else one after the other."""
        if not self._schedules(batches):
            return super().train_micro_batches(batches, loss_of, router)
        if self.optimizer is None:
            raise RuntimeError("MegatronStrategy.train_micro_batches: configure_optimizer first")
        routing = None
        if router is not None and self.moe_routers is not None:
            from reroll.strategies.megatron_moe import ScheduledRouting

            members = self.mp_group  # whose rows run together: the routers' members (``_row_split``)
            mine = torch.tensor(list(router.shares), dtype=torch.float32, device=self.device)
            shares = [torch.empty_like(mine) for _ in range(dist.get_world_size(members))]
            dist.all_gather(shares, mine, group=members)
            routing = ScheduledRouting(
                self.moe_routers, router.routing, torch.stack(shares), list(router.shares), self.vp
            )
        records = self._schedule(batches, loss_of, forward_only=False, routing=routing)
        if routing is not None:
            routing.finish()
        return records

    def score_micro_batches(self, batches: Sequence[MB], output_of: Callable[[MB], Record]) -> list[Record]:
        """A forward-only pass's outputs, pipeline stages running the micro-batches by the schedule's
        forward half where they can (``_schedules``)."""
        if not self._schedules(batches):
            return super().score_micro_batches(batches, output_of)
        return self._schedule(batches, output_of, forward_only=True)

    def _schedules(self, batches: Sequence[Any]) -> bool:
        """Whether the stages schedule these micro-batches (the same answer on every rank of a group):
        rows given as ``input_ids`` and ``attention_mask``. Under context parallelism too, for a dense
        model: a group's ranks run the same schedule in step, each stage's attention exchanging heads
        within its group, and the last stage's ranks gather their columns inside the loss together. A
        mixture of experts split by context parallelism runs one micro-batch after the other (its
        router term pools the group's columns, not yet scheduled), through every chunk of a virtual
        pipeline by ``_pipelined``."""
        if self.pipe is None or (self.context_parallel is not None and self.moe_routers is not None):
            return False
        return all(hasattr(mb, "input_ids") and hasattr(mb, "attention_mask") for mb in batches)

    def _schedule(
        self,
        batches: Sequence[Any],
        fn: Callable[[Any], Any],
        *,
        forward_only: bool,
        routing: ScheduledRouting | None = None,
    ) -> list[Any]:
        """``fn`` of every micro-batch by ``megatron_pipeline.run_schedule``, each micro-batch's rows
        gathered over the model-parallel group first (as ``logits`` gathers them)."""
        from reroll.strategies.megatron_pipeline import fillers, run_schedule

        assert self.pipe is not None
        counts = torch.tensor([len(batches), -len(batches)], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.mp_group)
        most, fewest = counts.tolist()  # one copy back
        if most != -fewest:
            raise RuntimeError(
                f"the ranks of a Megatron model-parallel group have from {-fewest} to {most} "
                "micro-batches: every rank must run as many"
            )
        group_rows = [self._group_rows(mb.input_ids, mb.attention_mask) for mb in batches]
        filler = torch.zeros((1, 1), dtype=torch.long)  # one token: what a micro-batch costs least
        group_rows += [self._group_rows(filler, filler + 1) for _ in range(fillers(most, self.pp, self.vp))]
        self._require()
        return run_schedule(
            self.pipe, self.models, group_rows, batches, fn, partial(self._stage_forward, routing=routing),
            partial(setattr, self, "_handed"), forward_only=forward_only,
            shapes=[self._hidden_shape(g.ids) for g in group_rows],
        )  # fmt: skip

    def _group_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> GroupRows:
        """The model-parallel group's rows of one micro-batch, as the stages run them."""
        from reroll.strategies.megatron_pipeline import GroupRows

        ids, mask = self._right_padded(input_ids, attention_mask)
        rows, mask, rows_of = _gather_rows(ids, mask, self.mp_group)
        model_ids, positions, causal, t = self._model_inputs(rows)
        return GroupRows(rows, mask, rows_of, model_ids, positions, causal, t, self._spans(rows_of))

    def _hidden_shape(self, ids: torch.Tensor) -> tuple[int, int, int]:
        """The ``[s, b, h]`` hidden states a stage sends on for the model's input ``ids`` (``(b, s)``): the
        sequence split over the TP ranks under sequence parallelism."""
        seq = ids.shape[1] // self.tp if self._sequence_parallel() else ids.shape[1]
        return seq, ids.shape[0], self.shape.hidden_size

    def _stage_forward(
        self, g: GroupRows, i: int, chunk: int = 0, routing: ScheduledRouting | None = None
    ) -> torch.Tensor:
        """Model chunk ``chunk``'s output for the group's rows ``g`` (micro-batch ``i``) under the
        schedule: the hidden states it sends on, or the last stage's last chunk's ``(rows, t, V)`` logits,
        their gradient summed over the TP group (as the ``logits`` of a TP group's rows); ``routing``:
        with its routers' term attached."""
        assert self.pipe is not None
        run = partial(self.models[chunk], g.ids, g.positions, g.causal)
        if routing is None:
            out = run()
        else:  # the routers told of the forward as ``logits`` tells them
            start = partial(self._start_routing, g.mask, g.ids.shape[1], g.rows_of)
            out = routing.forward(i, chunk, start, run)
        if not (self.pipe.last and chunk == self.vp - 1):
            return out
        out = out[:, : g.t, : self.shape.vocab_size].to(DTYPES[self.dtype])
        return out if self.tp == 1 else _SumGradOverGroup.apply(out, self.tp_group)

    def step(self, grad_clip: float) -> dict[str, float]:
        """Sum gradients over data-parallel ranks, clip, step; the pre-clip gradient norm and the lr used."""
        from megatron.core.distributed import finalize_model_grads

        if self.optimizer is None:
            raise RuntimeError("MegatronStrategy.step: configure_optimizer first")
        finalize_model_grads(self.models)  # DP sum; sequence-parallel norm grads over TP; tied embedding
        lr = self.lr * warmup_factor(self.steps, self.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())  # over every chained optimizer's grads
        if not math.isfinite(grad_norm):  # skipped: no update, the schedule does not advance
            self._zero_grad()
            return {"grad_norm": grad_norm, "lr": float(lr), "skipped": 1.0}
        if grad_clip > 0:
            self._clip(grad_clip, grad_norm)
        self.optimizer.step_with_ready_grads()
        self._zero_grad()
        self.steps += 1
        return {"grad_norm": grad_norm, "lr": float(lr), "skipped": 0.0}

    def _clip(self, max_norm: float, total_norm: float) -> None:
        """Scale the gradients of every chained optimizer (a mixture of experts chains the dense weights'
        and the experts': ``clip_grad_norm`` of the chain reaches for a single optimizer) to ``max_norm``."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = [] if getattr(o, "is_stub_optimizer", False) else o.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=total_norm)

    def _zero_grad(self) -> None:
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()

    # -- weights out and in ----------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight, gathered over the TP ranks, (experts) the EP ranks and the pipeline stages, on CPU,
        in Hugging Face names (all ranks must call)."""
        return dict(self.named_weights(on_device=False))

    def named_weights(self, *, on_device: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight in Hugging Face names, one decoder layer at a time, gathered over the TP and EP
        ranks and the pipeline stages (``reroll.strategies.megatron_weights``): on the device
        (``on_device``) or on CPU. A collective: every rank iterates to the end, and gets all."""
        self._require()
        if self.lora is not None:  # the adapters merged into this rank's shard of each weight
            return self.hf_named([megatron_lora.merged_state(m) for m in self.chunks], on_device=on_device)
        weights = [
            {k: v.detach() for k, v in m.state_dict().items() if not k.endswith("_extra_state")}
            for m in self.chunks
        ]
        return self.hf_named(weights, on_device=on_device)

    def adapter_update(self) -> AdapterUpdate:
        """The adapters in peft's saved names and their ``LoraConfig`` (rank 0's; the others' tensors are
        empty): a collective, every rank calls it (``megatron_lora.peft_adapters``)."""
        if self.lora is None:
            raise RuntimeError("adapter_update needs strategy.lora")
        return AdapterUpdate(megatron_lora.peft_adapters(self), lora_config_dict(self.lora))

    def adapters_disabled(self) -> contextlib.AbstractContextManager[None]:
        """The base model while inside: every adapter skipped (a LoRA run's reference policy)."""
        if self.lora is None:
            raise RuntimeError("adapters_disabled needs strategy.lora")
        return megatron_lora.disabled(self.chunks)

    def hf_named(
        self, local: Sequence[Mapping[str, torch.Tensor]], *, on_device: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``local`` (of each model chunk, tensors named and shaped as its ``GPTModel`` state: its weights,
        or an optimizer state of theirs) in Hugging Face names, gathered as ``named_weights`` gathers
        them."""
        groups = Groups(self.tp, self.tp_group, self.ep, self.ep_group, self.pipe, self.device, self.vp)
        return hf_weights(local, self.shape, groups, on_device=on_device)

    def save(self, directory: Path, *, with_optimizer: bool) -> None:
        """Hugging Face weights into ``directory/model`` (``export``) and the optimizer state into
        ``directory/optimizer`` in the same layout-free form, every rank writing its share
        (``reroll.strategies.megatron_optimizer_state``). A collective: every rank calls it."""
        directory.mkdir(parents=True, exist_ok=True)
        self.export(directory / "model")
        if self.lora is not None:  # the merged model above; peft's adapter/; each rank's adapters and state
            update = self.adapter_update()
            if self.rank == 0:
                save_adapter(directory / "adapter", update)
            megatron_lora.save(self, directory, with_optimizer=with_optimizer)
        elif with_optimizer and self.optimizer is not None:
            optimizer_state.save_optimizer_state(self, directory / optimizer_state.DIRECTORY)

    def export(self, directory: Path) -> int:
        """Write the model as ``save_pretrained`` would, one decoder layer at a time (``write_layers``),
        with the checkpoint's generation config (where it has one). A collective; returns ``write_layers``'
        bound on the bytes this rank held at once."""
        model = self.meta_hf_model(DTYPES[self.dtype])
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(self.model_path)
        held = self.write_layers(directory, model, self.named_weights(on_device=False))
        log.info(
            "megatron: rank %d wrote its share of %s, holding at most %.2f GB",
            self.rank,
            directory,
            held / 1e9,
        )
        return held

    def write_layers(
        self, directory: Path, model: torch.nn.Module, named: Iterator[tuple[str, torch.Tensor]]
    ) -> int:
        """``named`` (whole tensors in Hugging Face names, one decoder layer at a time: ``named_weights``
        or ``hf_named``) as ``save_pretrained`` of ``model`` (on the meta device: the names, shapes, dtype
        and weight conversions) would write them, every rank writing its share of the files
        (``hf_export``: ranks write in parallel, none holds more than about two layers). A collective;
        returns a bound on the bytes of whole tensors this rank held at once: the writer's most (the unit
        written, the one gathered) plus the stream reader's most."""
        shapes = distinct_state(model)  # a tied head's copy dropped, as save_pretrained drops it
        units = layer_units(model, shapes, decoder_layers(model))
        stream = StreamGather(named, units)
        held = write_hf_model(
            directory, HFNames(model), shapes, units, stream, rank=self.rank, world_size=self.world_size
        )
        stream.finish()
        return held + stream.peak_bytes

    def meta_hf_model(self, dtype: torch.dtype) -> torch.nn.Module:
        """The Hugging Face model on the meta device in ``dtype``: the names, shapes and dtypes of what is
        written, its config and weight conversions."""
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config, dtype=dtype)

    def load(self, directory: Path) -> None:
        """Weights from ``directory/model`` and, where present, the optimizer state: ``optimizer/``, read at
        this rank's layout whatever the layout that wrote it, or an older checkpoint's
        ``optimizer_rank{r}.pt`` at the layout that wrote them. A collective: every rank calls it."""
        self._require()
        if self.lora is not None:  # the base stays model.path's: the adapters (and their state) from here
            megatron_lora.load(self, directory)
            return
        restore = None
        if self.optimizer is not None:  # refuses a checkpoint it cannot resume before reading weights
            restore = optimizer_state.restorer(self, directory, self._shares())
        self._load_hf(directory / "model")
        if self.optimizer is None:
            return
        self.optimizer.reload_model_params()  # main params from the loaded weights
        if restore is not None:
            restore()

    # -- colocation ------------------------------------------------------------------------------

    def offload(self) -> None:
        """Parameters, gradient buffers and optimizer state to CPU, every tensor kept (only its GPU storage
        is freed): Megatron DDP's grad hooks sit on the parameters and the distributed optimizer's fp32
        shards are views of DDP's buffers, so moving ``p.data`` would silently detach them. DDP's
        contiguous buffers move by Megatron's own ``offload_to_cpu``; every other storage (the optimizer's
        main parameters and moments, a frozen model's weights) is parked in page-locked host buffers of
        its exact size, kept for later offloads (``HostParking.park_storages``)."""
        self._require()
        if self._restore:
            return  # already offloaded
        buffers = self._ddp_buffers()
        restore = self._parked.park_storages(self._parked_storages(buffers))
        for b in buffers:
            b.offload_to_cpu(move_params=True, move_grads=True)
            restore.append(partial(b.reload_from_cpu, move_params=True, move_grads=True))
        self._restore = restore
        torch.cuda.empty_cache()

    def prepare_offload(self, worth_it: Callable[[int], bool]) -> None:
        """The host buffers of the storages ``offload`` parks as they are now (the optimizer's moments once
        its first step made them); DDP's buffers move by Megatron's own ``offload_to_cpu``."""
        if self.model is None or self.device.type != "cuda" or self._restore:
            return  # not built yet (``init_distributed``), off GPUs, or parked now
        shapes = [((st.nbytes(),), torch.uint8) for st in self._parked_storages(self._ddp_buffers())]
        if shapes and worth_it(sum(n for (n,), _ in shapes)):
            self._parked.prepare(shapes, self.device)

    def _ddp_buffers(self) -> list[Any]:
        """DDP's contiguous param/grad buffers (experts' apart: reduced over the expert-data-parallel
        ranks); none for a frozen model."""
        if not self.trainable:
            return []
        return [b for m in self.models for b in (*m.buffers, *m.expert_parallel_buffers)]

    def _parked_storages(self, buffers: list[Any]) -> list[torch.UntypedStorage]:
        """The GPU storages ``offload`` parks in host memory: the parameters' and the optimizer's (main
        parameters and moments), each once, but those DDP's ``buffers`` hold (they move their own way)."""
        views = {
            t.untyped_storage().data_ptr()
            for b in buffers
            for t in (b.param_data, b.grad_data)
            if t is not None
        }
        tensors = [p for m in self.chunks for p in m.parameters()]
        for inner in (
            o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]) if o
        ):
            tensors += [p for g in inner.param_groups for p in g["params"]]  # main params (may be views)
            tensors += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if t.is_cuda}
        return [st for ptr, st in storages.items() if ptr not in views and st.nbytes()]

    def reload(self) -> None:
        for bring_back in self._restore:
            bring_back()
        self._restore = []
