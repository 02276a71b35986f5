"""A Megatron training step's wall time on pipeline stages: the micro-batches one after the other (each
crossing the stages while the others wait) against the 1F1B schedule (``MegatronStrategy.train_micro_
batches``, ``reroll.strategies.megatron_pipeline.run_schedule``), and the same for a forward-only pass.

    python benchmarks/megatron_pipeline_schedule.py                         # 8 layers of hidden 256, PP=2
    python benchmarks/megatron_pipeline_schedule.py --micro-batches 2 4 8 16 --steps 3
    python benchmarks/megatron_pipeline_schedule.py --moe 4                 # a Qwen3-MoE, its router loss
    python benchmarks/megatron_pipeline_schedule.py --virtual 2             # and interleaved, 2 chunks a stage

A Qwen2-shaped model (or a Qwen3-MoE, ``--moe``) with random init (nothing downloaded, fp32), Megatron-Core on CPU ranks over gloo
(its CUDA calls pointed at the CPU, ``tests/integration/megatron_cpu.py``), each rank a process of its
own on one core (``sched_setaffinity``, one thread), the ranks the pipeline stages. Each rank's rows are
cut into ``--micro-batches`` micro-batches of ``--rows`` rows of ``--tokens`` tokens; a step is
``train_micro_batches`` (next-token loss) and the optimizer step. Both ways run in the same processes,
alternating, after one unmeasured step each; the median of ``--steps`` is printed (rank 0's clock, the
ranks synchronised by a barrier before each). With ``p`` stages and ``m`` micro-batches the schedule's
ideal is ``(m + p - 1) / (m p)`` of the sequential time (the pipeline's fill and drain). With
``--virtual v`` the same steps run again in fresh processes at ``v`` model chunks a stage
(``strategy.megatron.virtual_pipeline``, Megatron-Core's interleaved schedule; a dense model only),
whose ideal is ``(m + (p - 1) / v) / (m p)``: the fill and drain shrink by ``v``, each of the ``v``
crossings moving 1/v of the layers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.checkpoint_memory import rank_rows  # noqa: E402
from benchmarks.grpo_step import device_name  # noqa: E402


@dataclass(frozen=True)
class Rows:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def build_model(root: Path, layers: int, hidden: int, vocab: int, experts: int) -> Path:
    """A random Qwen2 of this shape, or (``experts``) a Qwen3-MoE with that many experts, 2 a token."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    shape = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    if experts:
        config = Qwen3MoeConfig(
            **shape, head_dim=64, intermediate_size=4 * hidden, moe_intermediate_size=2 * hidden,
            num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], router_aux_loss_coef=0.01, output_router_logits=True,
        )  # fmt: skip
    else:
        config = Qwen2Config(**shape, intermediate_size=4 * hidden)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    return root / "model"


def _rank(rank: int, world_size: int, port: int, config: Path, shape: str, out: Path, results) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    from tests.integration.megatron_cpu import patch_cuda_for_cpu

    patch_cuda_for_cpu()
    from reroll.algorithms.logprobs import token_logprobs
    from reroll.config.loader import load_config
    from reroll.config.schema import RunConfig
    from reroll.models.moe import StepRouting
    from reroll.strategies.megatron import MegatronStrategy
    from reroll.strategies.micro_batches import MicroBatchLoop, RouterLoss

    micro_batches, rows, tokens, steps, virtual = (int(x) for x in shape.split(","))
    sizes = [
        f"strategy.megatron.pipeline_parallel={world_size}",
        f"strategy.megatron.virtual_pipeline={virtual}",
    ]
    cfg = load_config(config, RunConfig, ["strategy.name=megatron", *sizes])
    s = MegatronStrategy(cfg.model.path, cfg=cfg, device="cpu", rank=rank, world_size=world_size)
    s.init_distributed(f"127.0.0.1:{port}")
    s.configure_optimizer(lr=1e-5, betas=(0.9, 0.99), weight_decay=0.0, warmup_steps=0)
    g = torch.Generator().manual_seed(rank)
    mbs = [
        Rows(
            torch.randint(0, s.shape.vocab_size, (rows, tokens), generator=g), torch.ones(rows, tokens).long()
        )
        for _ in range(micro_batches)
    ]
    n_tokens = float(world_size * micro_batches * rows * tokens)

    def loss_of(mb: Rows) -> tuple[torch.Tensor, None]:
        return -token_logprobs(s.logits(mb.input_ids, mb.attention_mask), mb.input_ids).sum() / n_tokens, None

    def scored(mb: Rows) -> torch.Tensor:
        return token_logprobs(s.logits(mb.input_ids, mb.attention_mask), mb.input_ids)

    def train(scheduled: bool) -> None:
        router = None  # a mixture of experts: its router's load-balancing term, as the trainer adds it
        if s.moe_routers is not None:
            routing = StepRouting(s.moe_routers, s.moe_routers.coef(None))
            router = RouterLoss(routing, [1 / (world_size * micro_batches)] * micro_batches)
        way = s.train_micro_batches if scheduled else partial(MicroBatchLoop.train_micro_batches, s)
        way(mbs, loss_of, router)
        s.step(1.0)

    @torch.no_grad()
    def score(scheduled: bool) -> None:
        (s.score_micro_batches if scheduled else partial(MicroBatchLoop.score_micro_batches, s))(mbs, scored)

    times: dict[tuple[str, bool], list[float]] = {}
    for i in range(steps + 1):
        for name, call in (("train step", train), ("forward-only", score)):
            for scheduled in (False, True) if virtual == 1 else (True,):  # interleaved: scheduled only
                torch.distributed.barrier()
                start = time.perf_counter()
                call(scheduled)
                if i:  # the first of each: unmeasured
                    times.setdefault((name, scheduled), []).append(time.perf_counter() - start)
    results.put((rank, {k: statistics.median(v) for k, v in times.items()}))
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--moe", type=int, default=0, help="a Qwen3-MoE of this many experts (2 a token)")
    parser.add_argument("--virtual", type=int, default=1, help="also interleaved: model chunks a stage")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root, args.layers, args.hidden, args.vocab, args.moe)
        config = root / "c.yaml"
        config.write_text(
            f"pipeline: rlvr\nname: b\noutput_dir: {root}/runs\nmodel: {{path: {model}, dtype: float32}}\n"
            f"data: {{train_files: [{root}/x.jsonl]}}\n"
        )
        kind = (
            f"Qwen3-MoE shape ({args.moe} experts, 2 a token, router loss 0.01)"
            if args.moe
            else "Qwen2 shape"
        )
        print(
            f"{kind}, {args.layers} layers of hidden {args.hidden}, vocabulary {args.vocab}, fp32; "
            f"{args.stages} pipeline stages over gloo, each a process on one core of {device_name('cpu')} "
            f"({os.cpu_count()} cores); {args.rows} rows x {args.tokens} tokens a micro-batch a rank; "
            f"torch {torch.__version__}"
        )
        v = args.virtual
        header = f"{'pass':<14}{'micro-batches':>14}{'sequential s':>14}{'1F1B s':>9}{'ratio':>8}{'ideal':>8}"
        more = f"{f'VPP={v} s':>10}{'ratio':>8}{'ideal':>8}" if v > 1 else ""
        print(header + more)
        for m in args.micro_batches:
            times = {}
            for virtual in sorted({1, v}):
                shape = f"{m},{args.rows},{args.tokens},{args.steps},{virtual}"
                (root / f"m{m}v{virtual}").mkdir()
                rows = rank_rows(_rank, args.stages, config, shape, root / f"m{m}v{virtual}")
                times |= {(name, scheduled, virtual): t for (name, scheduled), t in rows[0][1].items()}
            p = args.stages
            for name in ("train step", "forward-only"):
                seq, sched = times[(name, False, 1)], times[(name, True, 1)]
                ideal = (m + p - 1) / (m * p)
                line = f"{name:<14}{m:>14}{seq:>14.2f}{sched:>9.2f}{sched / seq:>8.2f}{ideal:>8.2f}"
                if v > 1:
                    inter = times[(name, True, v)]
                    line += f"{inter:>10.2f}{inter / seq:>8.2f}{(m + (p - 1) / v) / (m * p):>8.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
