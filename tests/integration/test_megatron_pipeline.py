"""Megatron pipeline parallelism on CPU ranks over gloo (CUDA calls pointed at the CPU,
``tests/integration/megatron_cpu.py``): two stages train as one rank does.

Each pipeline rank is given half the rows, as the role splits a batch; the stages run the group's rows
together and each rank computes the loss of its own rows. The one-rank run takes the whole batch in one
micro-batch, with the same padding (zeros past each row's end), so both compute every position from the
same inputs in the same shapes: what can differ is only where sums are split differently.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from reroll.algorithms.logprobs import token_logprobs
from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from tests.conftest import write_config
from tests.integration.megatron_cpu import patch_cuda_for_cpu, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install 'reroll[megatron]')",
)

LR, STEPS, ROWS = 1e-3, 2, 8


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of random tokens (zeros past each row's end), lengths 24 down to 3."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (ROWS, 24), generator=g)
    mask = (torch.arange(24) < torch.linspace(24, 3, ROWS).long()[:, None]).long()
    return ids * mask, mask


def _megatron_rank(rank: int, world_size: int, address: str, cfg_path: str, sizes: list[str]):
    """This process as Megatron rank ``rank`` on the CPU (CUDA calls patched), its optimizer configured:
    the strategy, the batch's ids and mask, and the batch's count of scored tokens."""
    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    from reroll.strategies.megatron import MegatronStrategy

    cfg = load_config(cfg_path, RunConfig, ["strategy.name=megatron", *sizes])
    s = MegatronStrategy(cfg.model.path, cfg=cfg, device="cpu", rank=rank, world_size=world_size)
    s.init_distributed(address)
    s.configure_optimizer(lr=LR, betas=(0.9, 0.99), weight_decay=0.1, warmup_steps=0)
    ids, mask = _batch(s.shape.vocab_size)
    n_tokens = mask[:, 1:].sum()
    return s, ids, mask, n_tokens


def _train_rank(rank: int, world_size: int, address: str, out: str, cfg_path: str, sizes: list[str]) -> None:
    """``STEPS`` optimizer steps of next-token loss (token mean over the whole batch) on this rank's share
    of the rows; saves the losses, grad norms and the weights gathered to Hugging Face names."""
    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, sizes)
    share = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    width = int(mask[share].sum(-1).max())
    ids, mask = ids[share, :width], mask[share, :width]
    steps = []
    for _ in range(STEPS):
        logits = s.logits(ids, mask)
        loss = -(token_logprobs(logits, ids) * mask).sum() / n_tokens
        s.backward(loss)
        steps.append((float(loss), s.step(1.0)["grad_norm"]))
    with torch.no_grad():  # a forward-only pass (reference/old log-probs) after the steps
        scored = token_logprobs(s.logits(ids, mask), ids) * mask
    marked = [n for n, p in s.module.named_parameters() if getattr(p, "sequence_parallel", False)]
    saved = {"steps": steps, "scored": scored, "weights": s.full_state_dict(), "sequence_parallel": marked}
    if s.lora is not None:  # rank 0's adapters in peft's names (a collective: every rank asks)
        saved["adapters"] = s.adapter_update().tensors
    torch.save(saved, f"{out}/rank{rank}.pt")


def tiny_megatron_config(root: Path, layers: int) -> Path:
    """A config over a tiny fp32 model of ``layers`` decoder layers built in ``root`` (one data row)."""
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    model = build_tiny_model(
        root / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=layers, num_heads=2
    )
    data = root / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    assets = {"model": Path(model), "train": data, "test": data}
    return write_config(root / "c.yaml", assets, model={"path": str(model), "dtype": "float32"})


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return tiny_megatron_config(tmp_path_factory.mktemp("pp"), 4)


def _run(tmp_path: Path, cfg_path: Path, world_size: int, *sizes: str) -> list[dict]:
    """Each rank's steps, log-probs and gathered weights at ``world_size`` ranks, ``sizes`` the
    ``strategy.megatron`` overrides."""
    out = tmp_path / f"ranks{world_size}_{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    return run_ranks(_train_rank, world_size, out, str(cfg_path), [f"strategy.megatron.{s}" for s in sizes])


@pytest.mark.long  # three spawned ranks importing megatron-core: 40-95 s on 2 CPU cores; the CI sibling is
# tests/unit/test_megatron_convert.py::test_pipeline_stages_split_and_merge_are_exact
def test_two_pipeline_stages_train_as_one_rank(tmp_path, four_layers):
    """PP=2 (tied embedding: its copy on the last stage kept equal by summed gradients) against one rank:
    losses (the two ranks' summed), the gradient norm (clipped at 1.0), the log-probs of a forward-only
    pass after the steps and the weights gathered from both stages after ``STEPS`` Adam steps.

    The stages compute every position from the same inputs in the same shapes as the one rank, and each
    rank's rows' logit gradients reach the last stage unchanged, so the gradients are the one rank's;
    what differs is summation order: the loss is two partial sums (fp32, ~200 terms: relative error
    below 200 * 2**-24 ~ 1e-5), and the gradient norm's squares are summed per stage then across stages
    (the same bound). The norm scales every gradient alike when clipping, which Adam's m / sqrt(v)
    cancels but for its eps: a norm off in its last bits moves a weight (at most about 1 in size here)
    by a few ulps (1.2e-7 at 1.0) per step, so weights within 1e-6 after 2 steps, log-probs within 1e-5
    (measured: losses to 1e-7, norm to 5e-8, log-probs and weights bit-equal; with 5 layers split 2/3,
    weights to 5e-7)."""
    one = _run(tmp_path, four_layers, 1)[0]
    two = _run(tmp_path, four_layers, 2, "pipeline_parallel=2")
    assert all("model.layers.3.mlp.down_proj.weight" in r["weights"] for r in two)  # both stages gathered
    for step, (loss, norm) in enumerate(one["steps"]):
        assert two[0]["steps"][step][0] + two[1]["steps"][step][0] == pytest.approx(loss, rel=1e-5)
        assert two[0]["steps"][step][1] == two[1]["steps"][step][1] == pytest.approx(norm, rel=1e-5)
    assert one["steps"][0][1] > 1.0  # the clip acted
    torch.testing.assert_close(
        torch.cat([two[0]["scored"], _pad(two[1]["scored"], 24)]), one["scored"], atol=1e-5, rtol=0
    )
    for name, w in one["weights"].items():
        assert torch.equal(two[0]["weights"][name], two[1]["weights"][name]), name
        torch.testing.assert_close(two[0]["weights"][name], w, atol=1e-6, rtol=0)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def assert_train_as_one(one: dict, ranks: list[dict]) -> None:
    """``ranks``, each a share of the rows, trained as ``one`` rank on them all: their losses sum to its
    (rel 1e-5: fp32 sums of ~200 terms in another order), every rank's gradient norm is its, their
    log-probs joined are its (1e-5) and their weights are equal to each other and within 2 * lr * steps
    of its (Adam can turn rounding in a near-zero gradient into a step of up to lr)."""
    for step, (loss, norm) in enumerate(one["steps"]):
        assert sum(r["steps"][step][0] for r in ranks) == pytest.approx(loss, rel=1e-5)
        assert all(r["steps"][step][1] == pytest.approx(norm, rel=1e-5) for r in ranks)
    torch.testing.assert_close(
        torch.cat([_pad(r["scored"], 24) for r in ranks]), one["scored"], atol=1e-5, rtol=0
    )
    for name, w in one["weights"].items():
        assert all(torch.equal(ranks[0]["weights"][name], r["weights"][name]) for r in ranks), name
        torch.testing.assert_close(ranks[0]["weights"][name], w, atol=2 * LR * STEPS, rtol=0)


@pytest.mark.long  # five spawned ranks: about 4 minutes on 2 CPU cores
@pytest.mark.parametrize(
    "sizes",
    [
        ("pipeline_parallel=2", "tensor_parallel=2"),
        ("pipeline_parallel=2", "tensor_parallel=2", "sequence_parallel=true"),
        ("pipeline_parallel=2",),
    ],
    ids=["pp2-tp2", "pp2-tp2-sp", "pp2-dp2"],
)
def test_four_ranks_with_pipeline_stages_train_as_one_rank(tmp_path, four_layers, sizes):
    """Four ranks, each a quarter of the rows: two stages of TP 2 (also with sequence parallelism: a stage
    sends the next its TP rank's slice of the sequence), or two stages of two data-parallel ranks (their gradients
    summed, the optimizer state sharded over them). Losses and norms as for two stages; a TP split sums
    each matmul in two parts, so gradients differ from one rank's by rounding, and Adam can turn that
    into up to lr per step where a gradient is near zero: weights within 2 * lr * steps (measured at
    pp2-tp2: 6e-6)."""
    one = _run(tmp_path, four_layers, 1)[0]
    four = _run(tmp_path, four_layers, 4, *sizes)
    assert all(bool(r["sequence_parallel"]) == ("sequence_parallel=true" in sizes) for r in four)  # its norms
    assert_train_as_one(one, four)


def _train_routed_rank(
    rank: int, world_size: int, address: str, out: str, cfg_path: str, sizes: list[str], parts: int
) -> None:
    """As ``_train_rank`` for a mixture of experts, the router's load-balancing term added as the trainer
    adds it (``StepRouting``, each micro-batch's share its rows over the batch's); this rank's rows cut
    into ``parts`` micro-batches. Saves the steps, the router metrics and the gathered weights."""
    from reroll.models.moe import StepRouting

    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, sizes)
    mine = ROWS // world_size
    cuts = [
        slice(rank * mine + i * mine // parts, rank * mine + (i + 1) * mine // parts) for i in range(parts)
    ]
    steps, metrics = [], []
    for _ in range(STEPS):
        routing, total = StepRouting(s.moe_routers, ROUTER_COEF), 0.0
        for cut in cuts:
            width = int(mask[cut].sum(-1).max())
            i, m = ids[cut, :width], mask[cut, :width]
            with s.moe_routers.capture() as routed:
                logits = s.logits(i, m)
            loss = -(token_logprobs(logits, i) * m).sum() / n_tokens
            loss = loss + routing.term(routed, len(i) / ROWS)
            s.backward(loss)
            total += float(loss)
        steps.append((total, s.step(1.0)["grad_norm"]))
        metrics.append(routing.metrics("actor"))
    torch.save({"steps": steps, "metrics": metrics, "weights": s.full_state_dict()}, f"{out}/rank{rank}.pt")


ROUTER_COEF = 0.1


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory) -> Path:
    from reroll.config.model import TinyMoEConfig
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("pp_moe")
    moe = TinyMoEConfig(experts=4, top_k=2, expert_hidden_size=64)
    model = build_tiny_model(
        root / "model", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_layers=4, num_heads=2, moe=moe
    )
    data = root / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    assets = {"model": Path(model), "train": data, "test": data}
    return write_config(root / "c.yaml", assets, model={"path": str(model), "dtype": "float32"})


@pytest.mark.long  # three spawned ranks of a mixture of experts: about 2 minutes on 2 CPU cores
def test_a_mixture_of_experts_on_two_stages_trains_as_two_ranks_do(tmp_path, small_moe):
    """A Qwen3-MoE on two stages, each rank given half the rows, against one rank taking the same halves
    as two micro-batches (the router's loss is each rank's rows', pooled over every layer: what two
    data-parallel ranks compute). Each stage sees both ranks' rows through its own layers; the loss each
    rank reports and the gradient of the sum must be the unsplit ones. The one rank runs 4 rows where the
    stages run 8, so their sums differ by rounding: losses and norm within 1e-5 (fp32, a few hundred
    terms), the router's mean loss within 1e-5 (a top-k choice flips only at a near tie), weights within
    2 * lr * steps (Adam on near-zero gradients)."""
    out = tmp_path / "one"
    out.mkdir()
    one = run_ranks(_train_routed_rank, 1, out, str(small_moe), [], 2)[0]
    out = tmp_path / "two"
    out.mkdir()
    two = run_ranks(_train_routed_rank, 2, out, str(small_moe), ["strategy.megatron.pipeline_parallel=2"], 1)
    assert one["metrics"][0]["actor/router_aux_loss"] > 0
    for step, (loss, norm) in enumerate(one["steps"]):
        assert two[0]["steps"][step][0] + two[1]["steps"][step][0] == pytest.approx(loss, rel=1e-5)
        assert two[0]["steps"][step][1] == two[1]["steps"][step][1] == pytest.approx(norm, rel=1e-5)
        aux = [r["metrics"][step]["actor/router_aux_loss"] for r in two]
        assert sum(aux) / 2 == pytest.approx(one["metrics"][step]["actor/router_aux_loss"], rel=1e-5)
    for name, w in one["weights"].items():
        assert torch.equal(two[0]["weights"][name], two[1]["weights"][name]), name
        torch.testing.assert_close(two[0]["weights"][name], w, atol=2 * LR * STEPS, rtol=0)


# -- the step's micro-batches scheduled (1F1B) against one after the other ----------------------------


@dataclass(frozen=True)
class _Rows:
    """A micro-batch as the schedule takes it: rows with their ``input_ids`` and ``attention_mask``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def next_token_fns(s: Any, n_tokens: int) -> tuple[Callable, Callable]:
    """A micro-batch's next-token loss (token mean over ``n_tokens`` of the whole batch) with its record,
    and its masked log-probs, through strategy ``s``'s logits: what the scheduled tests train and score."""

    def loss_of(mb: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
        logits = s.logits(mb.input_ids, mb.attention_mask)
        loss = -(token_logprobs(logits, mb.input_ids) * mb.attention_mask).sum() / n_tokens
        return loss, loss.detach()

    def scored(mb: _Rows) -> torch.Tensor:
        return token_logprobs(s.logits(mb.input_ids, mb.attention_mask), mb.input_ids) * mb.attention_mask

    return loss_of, scored


def _scheduled_rank(
    rank: int,
    world_size: int,
    address: str,
    out: str,
    cfg_path: str,
    sizes: list[str],
    scheduled: bool,
    rows: int = 1,
) -> None:
    """``STEPS`` optimizer steps of next-token loss on this rank's share of the rows cut into micro-batches
    of ``rows`` rows, through ``train_micro_batches`` (``scheduled``) or the one-after-the-other loop every
    strategy has; then a forward-only pass the same way. A mixture of experts adds its router's
    load-balancing term as the trainer does (``StepRouting``). Saves the losses, grad norms, router
    metrics, log-probs and weights."""
    from reroll.models.moe import StepRouting
    from reroll.strategies.micro_batches import MicroBatchLoop, RouterLoss

    schedules = _counted_schedules()
    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, sizes)
    mine = ROWS // world_size
    mbs = []
    for row in range(rank * mine, (rank + 1) * mine, rows):
        width = int(mask[row : row + rows].sum(-1).max())
        mbs.append(_Rows(ids[row : row + rows, :width], mask[row : row + rows, :width]))

    loss_of, scored = next_token_fns(s, n_tokens)

    train = s.train_micro_batches if scheduled else partial(MicroBatchLoop.train_micro_batches, s)
    score = s.score_micro_batches if scheduled else partial(MicroBatchLoop.score_micro_batches, s)
    steps, metrics = [], []
    for _ in range(STEPS):
        routing = StepRouting(s.moe_routers, ROUTER_COEF) if s.moe_routers is not None else None
        router = None if routing is None else RouterLoss(routing, [len(mb.input_ids) / ROWS for mb in mbs])
        losses = train(mbs, loss_of, router)
        steps.append(([float(v) for v in losses], s.step(1.0)["grad_norm"]))
        metrics.append(routing.metrics("actor") if routing is not None else {})
    with torch.no_grad():
        logprobs = [_pad(x.cpu(), 24) for x in score(mbs, scored)]
    saved = {
        "steps": steps,
        "metrics": metrics,
        "scored": torch.cat(logprobs),
        "weights": s.full_state_dict(),
    }
    torch.save(saved | {"schedules": schedules}, f"{out}/rank{rank}.pt")


def _counted_schedules() -> list[bool]:
    """Each ``run_schedule`` call's ``forward_only`` from now on in this process: the schedule ran, not
    the loop every strategy has."""
    import reroll.strategies.megatron_pipeline as pipeline

    calls, run = [], pipeline.run_schedule
    pipeline.run_schedule = lambda *a, **k: calls.append(k["forward_only"]) or run(*a, **k)
    return calls


def _run_scheduled(
    tmp_path: Path, cfg_path: Path, world_size: int, scheduled: bool, *sizes: str, rows: int = 1
) -> list[dict]:
    out = tmp_path / f"{'scheduled' if scheduled else 'sequential'}{world_size}"
    out.mkdir()
    overrides = [f"strategy.megatron.{s}" for s in sizes]
    return run_ranks(_scheduled_rank, world_size, out, str(cfg_path), overrides, scheduled, rows)


@pytest.mark.long  # 2 x 2 spawned ranks: about 75 s on 2 CPU cores; 2 x 4 ranks: about 4 minutes each
@pytest.mark.parametrize(
    "sizes",
    [
        ("pipeline_parallel=2",),
        ("pipeline_parallel=2", "tensor_parallel=2"),
        ("pipeline_parallel=2", "tensor_parallel=2", "sequence_parallel=true"),
        ("pipeline_parallel=2",),
    ],
    ids=["pp2", "pp2-tp2", "pp2-tp2-sp", "pp2-dp2"],
)
def test_stages_scheduled_equal_one_micro_batch_after_the_other(tmp_path, four_layers, sizes, request):
    """Pipeline stages, one-row micro-batches (four a rank at PP=2, two at four ranks): the 1F1B schedule
    (the last stage computing every rank's loss) against the same steps run one micro-batch after the
    other at the same sizes. Every micro-batch's group rows run through the same stages in the same
    shapes, each rank's loss is the same function of the same logits, its logits' gradient reaches the
    last stage unchanged (the schedule sums the ranks' losses, whose rows are disjoint: adding exact
    zeros; under TP the full gradient is summed over the TP group as before) and the weights' gradients
    accumulate over the micro-batches in the same order: losses, norms, log-probs and weights bit for
    bit."""
    world_size = 2 if request.node.callspec.id == "pp2" else 4
    one_by_one = _run_scheduled(tmp_path, four_layers, world_size, False, *sizes)
    scheduled = _run_scheduled(tmp_path, four_layers, world_size, True, *sizes)
    assert one_by_one[0]["steps"][0][1] > 1.0  # the clip acted
    assert all(r["schedules"] == [] for r in one_by_one)
    assert all(r["schedules"] == [False] * STEPS + [True] for r in scheduled)  # each step, then the scores
    for a, b in zip(one_by_one, scheduled):
        assert len(b["steps"][0][0]) == ROWS // world_size  # every micro-batch's record came back
        assert a["steps"] == b["steps"]
        assert torch.equal(a["scored"], b["scored"])
        for name, w in a["weights"].items():
            assert torch.equal(b["weights"][name], w), name


def _worker_rank(
    rank: int,
    world_size: int,
    address: str,
    out: str,
    cfg_path: str,
    batch: Any,
    scheduled: bool,
    more: list[str],
) -> None:
    """This process as rank ``rank`` of actor_train's ``TrainerWorker`` on two Megatron pipeline stages,
    given its share of ``batch`` (as a ``TrainerGroup`` splits it): a log-prob pass, an SFT step and an RL
    step, scheduled or (``scheduled`` false) each micro-batch one after the other."""
    from reroll.roles.objectives import NextToken, PolicyGradient
    from reroll.roles.trainer import TrainerWorker
    from reroll.strategies.megatron import MegatronStrategy

    torch.set_num_threads(1)
    patch_cuda_for_cpu()
    schedules = _counted_schedules()
    if not scheduled:
        MegatronStrategy._schedules = lambda self, batches: False
    sizes = [f"roles.actor_train.world_size={world_size}", "strategy.megatron.pipeline_parallel=2"]
    base = ["strategy.name=megatron", "optim.micro_batch_size=2", "runtime.backend=local"]
    cfg = load_config(cfg_path, RunConfig, [*base, *sizes, *more])
    worker = TrainerWorker("actor_train", rank, cfg, True)
    worker.init_distributed(address)
    worker.configure_optimizer(LR, 0)
    mine = batch.split(world_size)[rank]
    result = {
        "logprobs": worker.compute_logprobs(mine),
        "sft": worker.train(mine, NextToken()),
        "rl": worker.train(mine, PolicyGradient.of(cfg)),
        "weights": worker.strategy.full_state_dict(),
    }
    torch.save(result | {"schedules": schedules}, f"{out}/rank{rank}.pt")


def worker_batch(assets: dict, cfg_path: Path) -> Any:
    """The trainer-worker tests' batch: 10 SFT rows of the test data, with seeded advantages on their
    responses (for the RL step)."""
    from reroll.data.datasets import load_samples
    from reroll.models.loading import load_tokenizer
    from reroll.pipelines.common import sft_batch

    samples = load_samples([str(assets["train"])], template="{question}=")[:10]
    tokenizer = load_tokenizer(str(load_config(cfg_path, RunConfig).model.path))
    batch = sft_batch(samples, tokenizer, "{answer}")
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    batch.advantages *= batch.response_mask
    return batch


@pytest.mark.long  # 2 x 2 spawned ranks: about a minute and a half on 2 CPU cores
@pytest.mark.parametrize(
    ("model", "more"),
    [("four_layers", []), ("small_moe", ["model.router_aux_loss_coef=0.1"])],
    ids=["dense", "moe"],
)
def test_trainer_workers_on_two_stages_scheduled_equal_one_micro_batch_after_the_other(
    tmp_path, assets, request, model, more
):
    """The path a run takes: two actor_train ``TrainerWorker`` ranks on two stages, each given half of
    10 rows (micro-batches of 2 rows, the last stage computing both ranks' PPO and SFT losses and sending
    each its metrics), against the same workers with the schedule turned off: the log-prob pass, every
    metric of an SFT and an RL step (but the throughput) and the weights after them, bit for bit
    (``test_stages_scheduled_equal_one_micro_batch_after_the_other`` says why); a Qwen3-MoE with its
    router's load-balancing term too (each stage adding its part: ``ScheduledRouting``)."""
    cfg_path = request.getfixturevalue(model)
    batch = worker_batch(assets, cfg_path)
    runs = {}
    for scheduled in (False, True):
        out = tmp_path / f"scheduled_{scheduled}"
        out.mkdir()
        runs[scheduled] = run_ranks(_worker_rank, 2, out, str(cfg_path), batch, scheduled, more)
    assert all(r["schedules"] == [] for r in runs[False])
    assert all(r["schedules"] == [True, False, False] for r in runs[True])  # log-probs, SFT, RL
    for a, b in zip(runs[False], runs[True]):
        assert (a["logprobs"] != 0).sum() > 5
        assert torch.equal(a["logprobs"], b["logprobs"])
        for key, prefix in (("sft", "sft"), ("rl", "actor")):
            assert a[key][f"{prefix}/loss"] != 0
            assert model == "four_layers" or a[key][f"{prefix}/router_aux_coef"] == 0.1
            assert {k: v for k, v in a[key].items() if k != "train/tokens_per_s"} == {
                k: v for k, v in b[key].items() if k != "train/tokens_per_s"
            }, key
        for name, w in a["weights"].items():
            assert torch.equal(b["weights"][name], w), name


@pytest.mark.long  # 2 x 2 spawned ranks of a mixture of experts: about 40 s on 2 CPU cores; 2 x 4: minutes
@pytest.mark.parametrize(
    "sizes",
    [("pipeline_parallel=2",), ("pipeline_parallel=2", "tensor_parallel=2", "sequence_parallel=true")],
    ids=["pp2", "pp2-tp2-sp"],
)
def test_a_mixture_of_experts_on_two_stages_scheduled_equals_one_micro_batch_after_the_other(
    tmp_path, small_moe, sizes
):
    """A Qwen3-MoE on two stages with its router's load-balancing term, scheduled against the loop: each
    stage attaches its routers' part of the term to its output and gets the other stage's top-k counts
    by an all-gather waited for in the backward (``ScheduledRouting``), where the loop computes the same
    part inside each rank's loss; at TP=2 with sequence parallelism the TP ranks sum their columns' parts
    at once (as ``SplitRouted.term``); the forward-only pass as for a dense model. The same arithmetic in
    the same order: bit for bit."""
    world_size = 2 if len(sizes) == 1 else 4  # at TP=2 with SP each rank routes half of every row
    one_by_one = _run_scheduled(tmp_path, small_moe, world_size, False, *sizes)
    scheduled = _run_scheduled(tmp_path, small_moe, world_size, True, *sizes)
    assert all(r["schedules"] == [False] * STEPS + [True] for r in scheduled)
    assert one_by_one[0]["metrics"][0]["actor/router_aux_loss"] > 0
    for a, b in zip(one_by_one, scheduled):
        assert a["steps"] == b["steps"] and a["metrics"] == b["metrics"]
        assert torch.equal(a["scored"], b["scored"])
        for name, w in a["weights"].items():
            assert torch.equal(b["weights"][name], w), name
