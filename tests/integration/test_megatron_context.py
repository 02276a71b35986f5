"""Context parallelism in the Megatron strategy (``strategy.megatron.context_parallel``: Ulysses in the
core attention, ``reroll.strategies.megatron_context``) on CPU ranks over gloo, CUDA calls pointed at the
CPU (``tests/integration/megatron_cpu.py``): the attention and the rotary embedding of two ranks equal
the unsplit ones (seconds), and two ranks splitting every row train as one rank does (``-m long``):
the strategy alone, at CP=2, CP=2 x TP=2, CP=2 x PP=2 and CP=2 x PP=2 x VPP=2, and actor_train's ``TrainerWorker`` (the
worker's gather and combine of a group's columns, its micro-batches, SFT and RL steps).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from reroll.algorithms.logprobs import token_logprobs
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from tests.conftest import write_config
from tests.integration.megatron_cpu import patch_cuda_for_cpu, run_ranks
from tests.integration.test_megatron_pipeline import LR, ROWS, STEPS, _megatron_rank, _Rows, _run

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install 'reroll[megatron]')",
)

SEQ, BATCH, HEADS, GROUPS, DIM = 12, 2, 4, 2, 8  # 4 query heads over 2 key-value heads (GQA)


def _attention_rank(rank: int, world_size: int, address: str, out_dir: str) -> None:
    """Megatron's local attention on the whole sequence, and the Ulysses one on this rank's half of it
    (its own group of the two ranks), forward and backward on the same random inputs; and the rotary
    embedding of the whole sequence and of this rank's half. Saves both sides' outputs and gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reroll.strategies.context_parallel import ContextParallel
    from reroll.strategies.megatron_context import UlyssesDotProductAttention, causal_mask, chunk_rotary

    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world_size)
    ps.initialize_model_parallel()  # TP 1: the attention's tensor-parallel group, the memory buffer
    cp = ContextParallel(dist.new_group([0, 1]), rank, world_size)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=True,
    )
    kwargs = {"config": config, "layer_number": 1, "attn_mask_type": AttnMaskType.causal}
    whole_attention = DotProductAttention(attention_type="self", **kwargs)
    split_attention = UlyssesDotProductAttention(attention_type="self", cp=cp, **kwargs)
    g = torch.Generator().manual_seed(0)  # the same inputs on both ranks
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=g)
    k, v = (torch.randn(SEQ, BATCH, GROUPS, DIM, generator=g) for _ in range(2))
    weights = torch.randn(SEQ, BATCH, HEADS * DIM, generator=g)  # the loss: a weighted sum of the output
    mask = causal_mask(SEQ, q.device)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    out = whole_attention(*whole, mask)
    (out * weights).sum().backward()
    half = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    mine = [x[half].clone().requires_grad_() for x in (q, k, v)]
    split = split_attention(*mine, mask)
    (split * weights[half]).sum().backward()

    rope = RotaryEmbedding(kv_channels=DIM, rotary_percent=1.0, use_cpu_initialization=True)
    rope_whole = rope(SEQ)
    chunk_rotary(torch.nn.ModuleDict({"rotary_pos_emb": rope}), cp)  # a model holding it
    torch.save(
        {
            "whole": (out.detach(), *(x.grad for x in whole)),
            "split": (split.detach(), *(x.grad for x in mine)),
            "rope": (rope_whole, rope(SEQ // 2)),
            "half": half,
        },
        f"{out_dir}/rank{rank}.pt",
    )


def test_ulysses_attention_on_two_ranks_equals_the_unsplit_attention(tmp_path):
    """Each rank's half of the output, and of the gradients of a weighted sum of the whole output with
    respect to queries, keys and values, equal the unsplit attention's: every head attends over the same
    12 keys under the same mask, only batched with fewer heads, so the two differ by float32 rounding of
    sums of at most 12 (softmax) and 8 (head dim) terms of size ~1: within 1e-6 (bit-equal here). The
    rotary embedding a rank is given is the whole sequence's at its own positions, exactly."""
    ranks = run_ranks(_attention_rank, 2, tmp_path)
    for r in ranks:
        half = r["half"]
        for whole, split in zip(r["whole"], r["split"], strict=True):
            assert split.abs().sum() > 0  # the split side ran and reached every input
            torch.testing.assert_close(split, whole[half], atol=1e-6, rtol=0)
        whole_rope, mine = r["rope"]
        assert torch.equal(mine, whole_rope[half])
    assert not torch.equal(ranks[0]["rope"][1], ranks[1]["rope"][1])  # each rank its own positions


def _split_rank(
    rank: int,
    world_size: int,
    address: str,
    out: str,
    cfg_path: str,
    sizes: list[str],
    cp: int,
    tp: int,
    scheduled: bool = False,
) -> None:
    """As ``test_megatron_pipeline._train_rank``, the rows shared as the role shares them
    (``data_shards``: a context-parallel group's ranks get the same rows) and each rank's columns' logits
    gathered as the worker gathers them (``ContextParallel.gather``): ``STEPS`` Adam steps, then the
    scored tokens' log-probs by the worker's path (``scored_token_stats``: picks and combine).
    ``scheduled``: each step's rows in two micro-batches through ``train_micro_batches`` (the
    pipeline's schedule), the loss gathered inside it, and the log-probs by ``score_micro_batches``
    (the scored columns split at the width of the rows the last stage is handed, no collective)."""
    from reroll.roles.scored_tokens import scored_token_stats
    from reroll.strategies.context_parallel import data_shards

    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, sizes)
    split = s.context_parallel
    assert split is not None and split.size == cp
    parts = world_size // cp
    share = data_shards([slice(i * ROWS // parts, (i + 1) * ROWS // parts) for i in range(parts)], cp, tp)[
        rank
    ]
    width = int(mask[share].sum(-1).max())
    ids, mask = ids[share, :width], mask[share, :width]
    steps = []
    for _ in range(STEPS if scheduled else 0):

        def loss_of(mb: Any) -> tuple[torch.Tensor, float]:
            local = s.logits(mb.input_ids, mb.attention_mask)
            logprobs = token_logprobs(split.gather(local, mb.input_ids.shape[1]), mb.input_ids)
            loss = -(logprobs * mb.attention_mask).sum() / n_tokens
            return loss, float(loss.detach())

        half = len(ids) // 2
        mbs = [_Rows(ids[:half], mask[:half]), _Rows(ids[half:], mask[half:])]
        records = s.train_micro_batches(mbs, loss_of)
        steps.append((sum(records), s.step(1.0)["grad_norm"]))
    for _ in range(0 if scheduled else STEPS):
        local = s.logits(ids, mask)
        start, stop = split.columns(width)  # (a collective under TP or PP: the group's widest row)
        assert local.shape[1] == stop - start  # this rank's columns only
        loss = -(token_logprobs(split.gather(local, width), ids) * mask).sum() / n_tokens
        s.backward(loss)
        steps.append((float(loss), s.step(1.0)["grad_norm"]))

    def score(mb: Any) -> torch.Tensor:  # scheduled, the last stage runs it for each stage's rows
        w = mb.input_ids.shape[1]
        rows, cols = mb.attention_mask[:, 1:].bool().nonzero(as_tuple=True)  # every real next token
        scored, _ = scored_token_stats(
            s.model, lambda: s.logits(mb.input_ids, mb.attention_mask), rows * w + cols, rows, cols,
            mb.input_ids, 1.0, entropy=False, split=(split, w),
        )  # fmt: skip
        return scored

    with torch.no_grad():
        scored = s.score_micro_batches([_Rows(ids, mask)], score)[0] if scheduled else score(_Rows(ids, mask))
    weights = s.full_state_dict()
    sp = s.chunks[0].config.sequence_parallel  # the model ran as configured
    saved = {"steps": steps, "scored": scored, "weights": weights, "share": share, "sequence_parallel": sp}
    saved["schedules"] = s._schedules([_Rows(ids, mask)])
    torch.save(saved, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> Path:
    """A config over a tiny Qwen2 (a Qwen3-MoE of 4 experts, top-2, where ``moe``) of ``layers`` layers
    (2), 4 attention heads over ``kv`` key-value heads."""
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    def build(kv: int, moe: bool = False, layers: int = 2) -> Path:
        from reroll.config.model import TinyMoEConfig

        root = tmp_path_factory.mktemp(f"cp_kv{kv}_l{layers}")
        model = build_tiny_model(
            root / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=layers, num_heads=4,
            num_kv_heads=kv, for_cpu_engine=False, moe=TinyMoEConfig(experts=4, top_k=2) if moe else None,
        )  # fmt: skip
        data = root / "rows.jsonl"
        data.write_text('{"question": "1+1", "answer": "2"}\n')
        assets = {"model": Path(model), "train": data, "test": data}
        return write_config(root / "c.yaml", assets, model={"path": str(model), "dtype": "float32"})

    return build


@pytest.mark.long  # three spawned ranks importing megatron-core, five with TP or PP: 0.5-2 minutes each on
# 2 CPU cores; the CI sibling is test_ulysses_attention_on_two_ranks_equals_the_unsplit_attention
@pytest.mark.parametrize(
    ("kv", "tp", "pp", "sp", "vp", "scheduled"),
    [
        (2, 1, 1, False, 1, False),
        (4, 2, 1, False, 1, False),
        (4, 2, 1, True, 1, False),
        (2, 1, 2, False, 1, False),
        (2, 1, 2, False, 2, False),
        (2, 1, 2, False, 1, True),
        (2, 1, 2, False, 2, True),
    ],
    ids=[
        "cp2-gqa",
        "cp2-tp2",
        "cp2-tp2-sp",
        "cp2-pp2",
        "cp2-pp2-vp2",
        "cp2-pp2-1f1b",
        "cp2-pp2-vp2-interleaved",
    ],
)
def test_context_parallel_ranks_train_as_one_rank(tmp_path, gqa_model, kv, tp, pp, sp, vp, scheduled):
    """CP=2 (every row split over two ranks; 4 query heads over 2 key-value heads: one key-value head a
    rank), CP=2 x TP=2 (each TP rank half the rows, each split over two ranks; a rank attends with one
    head) and CP=2 x PP=2 (a layer a stage; with ``vp`` 2, four layers, two chunks a stage that the rows
    cross in turn, unscheduled: ``Pipeline.pass_on``) against one rank on the whole batch; under TP and PP a group
    runs its ranks' rows at the widest one's width, and every rank's columns are split at it; with
    sequence parallelism (``sp``) at a multiple of 4, each rank's columns scattered again over its two TP
    ranks for the norms and residuals, gathered for attention and the MLP. Compared:
    losses (the groups' summed), the gradient norm, log-probs of a forward-only pass after the steps (the
    worker's path: each rank's scored tokens, combined) and the weights after ``STEPS`` Adam steps.

    The split ranks compute every token's projections, MLP and head as the one rank does, and each head's
    attention over the same keys under the same mask (bit-equal: the CI sibling); what differs is
    summation order: a weight's gradient is summed over each rank's half of the tokens and then over the
    ranks (and under TP each matmul in two parts), a loss of two groups' partial sums. So the loss and
    the norm within rel 1e-5 (fp32, ~200 terms: 200 * 2**-24 ~ 1e-5), log-probs within 1e-5, and, as
    Adam can turn rounding in a near-zero gradient into a step of up to lr, weights within
    2 * lr * steps (``test_megatron_pipeline``'s bounds). Measured: losses and norms to 2e-7 (bit-equal at
    CP=2 alone), log-probs to 5e-7, weights to 7e-6."""
    from reroll.strategies.context_parallel import group_leaders

    cfg = gqa_model(kv, layers=2 * vp)
    one = _run(tmp_path, cfg, 1)[0]
    cp, world = 2, 2 * tp * pp
    parallel = (
        ("context_parallel", cp),
        ("tensor_parallel", tp),
        ("pipeline_parallel", pp),
        ("virtual_pipeline", vp),
    )
    sizes = [f"strategy.megatron.{k}={v}" for k, v in parallel]
    sizes.append(f"strategy.megatron.sequence_parallel={str(sp).lower()}")
    out = tmp_path / "split"
    out.mkdir()
    split = run_ranks(_split_rank, world, out, str(cfg), sizes, cp, tp, scheduled)
    assert all(r["schedules"] == (pp > 1) for r in split)  # dense: the stages schedule under CP
    leaders = group_leaders(split, cp, tp)
    assert all(r["sequence_parallel"] == sp for r in split)
    for step, (loss, norm) in enumerate(one["steps"]):
        assert sum(r["steps"][step][0] for r in leaders) == pytest.approx(loss, rel=1e-5)
        assert all(r["steps"][step][1] == pytest.approx(norm, rel=1e-5) for r in split)
    for r in split:
        assert r["scored"].abs().sum() > 0  # the forward-only pass ran
        expected = one["scored"][r["share"], : r["scored"].shape[1]]
        torch.testing.assert_close(r["scored"], expected, atol=1e-5, rtol=0)
    for name, w in one["weights"].items():
        assert all(torch.equal(split[0]["weights"][name], r["weights"][name]) for r in split), name
        torch.testing.assert_close(split[0]["weights"][name], w, atol=2 * LR * STEPS, rtol=0)


def _worker_rank(
    rank: int, world_size: int, address: str, out: str, cfg_path: str, overrides: list[str], batch
) -> None:
    """This process as rank ``rank`` of actor_train's ``TrainerWorker`` on Megatron (CUDA calls pointed at
    the CPU), given the rows a ``TrainerGroup`` gives it: a log-prob pass, an SFT step and an RL step."""
    from reroll.roles.objectives import NextToken, PolicyGradient
    from reroll.roles.trainer import TrainerWorker

    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    base = ["strategy.name=megatron", "optim.micro_batch_size=4", "runtime.backend=local"]
    cfg = load_config(cfg_path, RunConfig, [*base, f"roles.actor_train.world_size={world_size}", *overrides])
    worker = TrainerWorker("actor_train", rank, cfg, True)
    worker.init_distributed(address)
    worker.configure_optimizer(LR, 0)
    result = {
        "split": worker.context_parallel is not None,
        "logprobs": worker.compute_logprobs(batch),
        "sft": worker.train(batch, NextToken()),
        "rl": worker.train(batch, PolicyGradient.of(cfg)),
        "weights": worker.strategy.full_state_dict(),
    }
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.mark.long  # three spawned ranks: about a minute on 2 CPU cores
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_trainer_workers_of_a_context_parallel_group_train_as_one(tmp_path, gqa_model, assets, moe):
    """The path a run takes: two actor_train ``TrainerWorker`` ranks on Megatron at context parallel 2,
    both given the whole batch (a group's rows), against one rank: the log-prob pass (the scored tokens'
    log-probs combined over the group), an SFT and an RL step (micro-batches of 4 rows; the loss read
    off the gathered or combined values), to the bounds of ``test_context_parallel_ranks_train_as_one_rank``
    (the same arithmetic: only summation orders differ). Measured: log-probs and losses bit-equal, grad
    norms to 6e-8, weights to 6e-7. A Qwen3-MoE too: the trainer adds the router's load-balancing term,
    each rank routing its columns and pooling the rows' over the group (``SplitRouted``), so the router
    loss and the experts' load it logs are the one rank's (same bound as the loss)."""
    from reroll.data.datasets import load_samples
    from reroll.models.loading import load_tokenizer
    from reroll.pipelines.common import sft_batch

    cfg = gqa_model(2, moe=moe)
    samples = load_samples([str(assets["train"])], template="{question}=")[:10]
    batch = sft_batch(samples, load_tokenizer(str(load_config(cfg, RunConfig).model.path)), "{answer}")
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    batch.advantages *= batch.response_mask
    runs = {}
    coef = ["model.router_aux_loss_coef=0.1"] if moe else []
    for world, overrides in ((1, coef), (2, [*coef, "strategy.megatron.context_parallel=2"])):
        out = tmp_path / f"world{world}"
        out.mkdir()
        runs[world] = run_ranks(_worker_rank, world, out, str(cfg), overrides, batch)
    [one], two = runs[1], runs[2]
    assert not one["split"] and all(r["split"] for r in two)
    assert (one["logprobs"] != 0).sum() > 10
    for r in two:
        torch.testing.assert_close(r["logprobs"], one["logprobs"], atol=1e-5, rtol=0)
        for key, prefix in (("sft", "sft"), ("rl", "actor")):
            routed = ("router_aux_loss", "expert_load_max", "expert_load_entropy") if moe else ()
            assert all(f"{prefix}/{n}" in r[key] for n in routed)  # the router term ran
            for name in (f"{prefix}/{n}" for n in ("loss", "grad_norm", *routed)):
                assert r[key][name] == pytest.approx(one[key][name], rel=1e-5, abs=1e-7), (key, name)
    for name, w in one["weights"].items():
        assert torch.equal(two[0]["weights"][name], two[1]["weights"][name]), name
        torch.testing.assert_close(two[0]["weights"][name], w, atol=2 * LR * 2, rtol=0)
