"""Megatron's interleaved schedule (``strategy.megatron.virtual_pipeline``) on CPU ranks over gloo (CUDA
calls pointed at the CPU, ``tests/integration/megatron_cpu.py``): two stages of two model chunks each
run a step's micro-batches as two stages of one chunk do (bit for bit until the first optimizer step,
within rounding after it: the gradient norm's sums split per stage), train as one rank does within
rounding, through the trainer workers too, and any count of micro-batches; a mixture of experts with
its router loss trains as on two stages; a checkpoint moves between that layout and one rank.

A 4-layer model at PP=2 x VPP=2: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3, so a micro-batch
crosses the stages twice (0 -> 1 -> 0 -> 1). The micro-batches and the steps are
``test_megatron_pipeline``'s.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.integration.megatron_cpu import run_ranks
from tests.integration.test_megatron_pipeline import (  # noqa: F401 (four_layers, small_moe: fixtures)
    LR,
    ROWS,
    STEPS,
    _run_scheduled,
    four_layers,
    small_moe,
    tiny_megatron_config,
)
from tests.integration.test_megatron_resume import _config, _resume

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install 'reroll[megatron]')",
)


@pytest.mark.long  # 2 + 2 + 1 spawned ranks importing megatron-core: 35 s on 2 CPU cores (4 + 4 + 1: about 2
# minutes); the CI siblings are tests/unit/test_megatron_convert.py's virtual pipeline tests
@pytest.mark.parametrize("world_size", [2, 4], ids=["pp2", "pp2-dp2"])
def test_two_stages_of_two_chunks_train_as_two_stages_and_as_one_rank(tmp_path, four_layers, world_size):  # noqa: F811
    """PP=2 x VPP=2 against PP=2 (both scheduled: one-row micro-batches, four a rank, or two at two
    data-parallel ranks a stage, whose distributed optimizer shards every chunk's state; the last stage
    computing its pipeline group's losses) and against one rank taking the 8 rows one after the other.

    Against PP=2: every micro-batch's group rows cross the same layers in the same shapes (a chunk is a
    run of whole layers, its output sent on exactly, each micro-batch at its own shape: ``known_shapes_exchange``),
    each rank's loss is the same function of the same logits, and each weight's gradient accumulates
    over the micro-batches in the same order (the interleaved schedule runs every chunk's micro-batches
    in order, forward and backward; the tied embedding's two copies, on stage 0's chunk 0 and stage 1's
    chunk 1, are summed by ``finalize_model_grads`` as at PP=2): the first step's losses bit for bit,
    and the gradients. The gradient norm's squares are summed per stage over other layers ({0, 2} and
    {1, 3} against {0, 1} and {2, 3}): within rel 1e-5 (fp32 sums); it scales every gradient alike when
    clipping, which Adam's m / sqrt(v) cancels but for its eps, so the weights move apart by a few ulps a
    step (``test_megatron_pipeline``'s PP=2 test argues the bound): within 1e-6 after two, the later
    losses within rel 1e-5 and the log-probs after the steps within 1e-5.

    Against one rank: the stages run two rows together where the one rank runs one, so sums are split
    differently; the bounds are ``test_megatron_pipeline.assert_train_as_one``'s: losses (fp32 sums of
    ~200 terms) and the clipped gradient norm within rel 1e-5, log-probs within 1e-5, and weights within
    2 * lr * steps (Adam can turn rounding in a near-zero gradient into a step of up to lr). Measured:
    norms to 5e-8, later losses to 1e-7, log-probs to 5e-7, weights to 2.5e-7 (PP=2) and 3.3e-6 (one
    rank)."""
    from tests.integration.test_megatron_pipeline import _scheduled_rank

    interleaved = _run_scheduled(
        tmp_path, four_layers, world_size, True, "pipeline_parallel=2", "virtual_pipeline=2"
    )
    (tmp_path / "plain").mkdir()
    plain = _run_scheduled(tmp_path / "plain", four_layers, world_size, True, "pipeline_parallel=2")
    (tmp_path / "one").mkdir()
    (one,) = run_ranks(_scheduled_rank, 1, tmp_path / "one", str(four_layers), [], False)
    assert all(r["schedules"] == [False] * STEPS + [True] for r in interleaved)  # each step, then the scores
    assert one["steps"][0][1] > 1.0  # the clip acted
    assert all("model.layers.2.mlp.down_proj.weight" in r["weights"] for r in interleaved)  # chunk 1 of 0
    for a, b in zip(plain, interleaved):
        assert len(b["steps"][0][0]) == ROWS // world_size  # every micro-batch's record came back
        assert a["steps"][0][0] == b["steps"][0][0]  # the first step's losses
        for (losses, norm), (their_losses, their_norm) in zip(a["steps"], b["steps"]):
            assert their_losses == pytest.approx(losses, rel=1e-5)
            assert their_norm == pytest.approx(norm, rel=1e-5)
        torch.testing.assert_close(b["scored"], a["scored"], atol=1e-5, rtol=0)
        for name, w in a["weights"].items():
            torch.testing.assert_close(b["weights"][name], w, atol=1e-6, rtol=0)
    for step, (losses, norm) in enumerate(one["steps"]):
        assert sum(sum(r["steps"][step][0]) for r in interleaved) == pytest.approx(sum(losses), rel=1e-5)
        assert all(r["steps"][step][1] == pytest.approx(norm, rel=1e-5) for r in interleaved)
    joined = torch.cat([r["scored"] for r in interleaved])
    torch.testing.assert_close(joined, one["scored"], atol=1e-5, rtol=0)
    for name, w in one["weights"].items():
        assert all(torch.equal(interleaved[0]["weights"][name], r["weights"][name]) for r in interleaved), (
            name
        )
        torch.testing.assert_close(interleaved[0]["weights"][name], w, atol=2 * LR * STEPS, rtol=0)


@pytest.mark.long  # 2 x 2 spawned ranks of a mixture of experts: about 25 s on 2 CPU cores; 2 x 4: about 40 s
@pytest.mark.parametrize(
    ("sizes", "rows"),
    [((), 1), ((), 4), (("tensor_parallel=2", "sequence_parallel=true"), 1)],
    ids=["pp2", "pp2-one-and-a-filler", "pp2-tp2-sp"],
)
def test_a_mixture_of_experts_on_two_stages_of_two_chunks_trains_as_on_two_stages(
    tmp_path,
    small_moe,  # noqa: F811
    sizes,
    rows,
):
    """A Qwen3-MoE at PP=2 x VPP=2 against PP=2, both scheduled (four one-row micro-batches a rank, or one
    of four rows, which the interleaved schedule runs beside a one-token filler: without the router
    term; at TP=2 with sequence parallelism two one-row micro-batches a rank, each TP rank routing its
    half of every row, the TP ranks' parts summed at once) with the router's load-balancing term (coef
    0.1): each model chunk attaches its routers' part to its output and gets the other chunks' and
    stage's top-k counts by the all-gathers started after each chunk's forward, waited for in the
    micro-batch's backward (``ScheduledRouting``).

    The forward is the plain schedule's (the same layers on the same rows in the same shapes), and so are
    the top-k counts of every layer (integers, exact in fp32; joined in the model's layer order:
    ``layer_runs``), hence ``f`` and the gradient given to each router's probabilities (a constant per
    member and expert, whichever chunk holds the layer): the first step's losses and experts' load bit
    for bit. The router loss's ``P`` is summed per chunk then over chunks and stages, where PP=2 sums
    per stage ({0, 2} and {1, 3} against {0, 1} and {2, 3}), and the gradient norm's squares likewise:
    fp32 sums of a few hundred terms in another order, within rel 1e-5. From the second step the
    tolerances are ``test_megatron_pipeline``'s for a mixture of experts on stages: losses, norms and the
    router's mean loss within rel 1e-5 (a top-k choice flips only at a near tie), weights within 2 * lr *
    steps (Adam can turn rounding in a near-zero gradient into a step of up to lr). The norm checks the
    routers' gradient: with one chunk's part left out it moved by rel 4e-4 (measured), and the second
    step's router loss by 3e-3."""
    world_size = 4 if sizes else 2
    interleaved = _run_scheduled(tmp_path, small_moe, world_size, True, *VPP2, *sizes, rows=rows)
    (tmp_path / "plain").mkdir()
    plain = _run_scheduled(
        tmp_path / "plain", small_moe, world_size, True, "pipeline_parallel=2", *sizes, rows=rows
    )
    assert all(r["schedules"] == [False] * STEPS + [True] for r in interleaved)  # each step, then the scores
    assert all("model.layers.2.mlp.gate.weight" in r["weights"] for r in interleaved)
    for a, b in zip(plain, interleaved):
        assert a["metrics"][0]["actor/router_aux_loss"] > 0  # the term ran, on every rank
        assert a["metrics"][0]["actor/router_aux_coef"] == b["metrics"][0]["actor/router_aux_coef"] == 0.1
        assert len(b["steps"][0][0]) == ROWS // world_size // rows  # every micro-batch's, no filler's
        assert a["steps"][0][0] == b["steps"][0][0]  # the first step's losses
        load = [k for k in a["metrics"][0] if k.startswith("actor/expert_load")]
        assert len(load) == 3 and all(a["metrics"][0][k] == b["metrics"][0][k] for k in load)
        for step, ((losses, norm), (their_losses, their_norm)) in enumerate(zip(a["steps"], b["steps"])):
            assert their_losses == pytest.approx(losses, rel=1e-5)
            assert their_norm == pytest.approx(norm, rel=1e-5)
            aux = a["metrics"][step]["actor/router_aux_loss"]
            assert b["metrics"][step]["actor/router_aux_loss"] == pytest.approx(aux, rel=1e-5)
        torch.testing.assert_close(b["scored"], a["scored"], atol=1e-5, rtol=0)
        for name, w in a["weights"].items():
            assert torch.equal(interleaved[0]["weights"][name], b["weights"][name]), name
            torch.testing.assert_close(b["weights"][name], w, atol=2 * LR * STEPS, rtol=0)


VPP2 = ["pipeline_parallel=2", "virtual_pipeline=2"]


@pytest.mark.long  # 2 x 2 spawned ranks: about 30 s on 2 CPU cores (a mixture of experts: about 45 s)
@pytest.mark.parametrize("model", ["four_layers", "small_moe"])
def test_two_stages_of_two_chunks_run_one_micro_batch_after_the_other_as_scheduled(tmp_path, request, model):
    """PP=2 x VPP=2 outside the schedule (``logits`` one micro-batch at a time, as context parallelism
    and any caller of ``logits`` run it: each chunk's output handed round the ring of stages,
    ``Pipeline.pass_on``) against the interleaved schedule. A dense model's micro-batches cross the same
    layers in the same shapes, each rank's loss is the same function of the same logits and every
    weight's gradient accumulates over the micro-batches in the same order: losses, norms, log-probs and
    weights bit for bit. A mixture of experts' router term is summed over this rank's routers at once
    in the loop, per chunk under the schedule (fp32 sums in another order): the first step's losses bit
    for bit (the term enters the gradient, not the loss records), the rest within
    ``test_a_mixture_of_experts_on_two_stages_of_two_chunks_trains_as_on_two_stages``'s bounds."""
    cfg = request.getfixturevalue(model)
    one_by_one = _run_scheduled(tmp_path, cfg, 2, False, *VPP2)
    (tmp_path / "scheduled").mkdir()
    scheduled = _run_scheduled(tmp_path / "scheduled", cfg, 2, True, *VPP2)
    assert all(r["schedules"] == [] for r in one_by_one)  # the loop: no schedule ran
    assert all(r["schedules"] == [False] * STEPS + [True] for r in scheduled)
    for a, b in zip(one_by_one, scheduled):
        assert len(a["steps"][0][0]) == ROWS // 2  # every micro-batch's record came back
        if model == "four_layers":
            assert a["steps"] == b["steps"]
            assert torch.equal(a["scored"], b["scored"])
            assert all(torch.equal(b["weights"][name], w) for name, w in a["weights"].items())
            continue
        assert a["metrics"][0]["actor/router_aux_loss"] > 0  # the term ran
        assert a["steps"][0][0] == b["steps"][0][0]
        for (losses, norm), (their_losses, their_norm) in zip(a["steps"], b["steps"]):
            assert their_losses == pytest.approx(losses, rel=1e-5)
            assert their_norm == pytest.approx(norm, rel=1e-5)
        torch.testing.assert_close(b["scored"], a["scored"], atol=1e-5, rtol=0)
        for name, w in a["weights"].items():
            torch.testing.assert_close(b["weights"][name], w, atol=2 * LR * STEPS, rtol=0)


@pytest.mark.long  # two spawned ranks and one: about 40 s each on 2 CPU cores
@pytest.mark.parametrize(
    ("saving", "resuming"), [((2, VPP2), (1, [])), ((1, []), (2, VPP2))], ids=["vpp2-to-1", "1-to-vpp2"]
)
def test_a_checkpoint_moves_between_two_stages_of_two_chunks_and_one_rank(tmp_path, saving, resuming):
    """A tied bf16 model saved after two steps at PP=2 x VPP=2 (each rank's one micro-batch and a filler:
    the interleaved schedule runs at least pipeline_parallel micro-batches) resumes on one rank, and the
    other way: the optimizer state loaded is what was saved, bit for bit (every model chunk's share of
    it written and read in the layout-free form), and the next step matches the uninterrupted run's
    within ``check_step``'s bound (``test_megatron_resume``)."""
    _resume(tmp_path, _config(tmp_path), saving, resuming)
    saved_at = json.loads((tmp_path / "save" / "ck" / "optimizer" / "state.json").read_text())["saved_at"]
    assert saved_at["virtual_pipeline"] == (2 if saving[0] == 2 else 1)


@pytest.mark.long  # 2 x 2 spawned ranks: 25 s on 2 CPU cores (a mixture of experts: about 40 s)
@pytest.mark.parametrize(
    ("model", "more"),
    [("four_layers", []), ("small_moe", ["model.router_aux_loss_coef=0.1"])],
    ids=["dense", "moe"],
)
def test_trainer_workers_on_two_stages_of_two_chunks_train_as_on_two_stages(
    tmp_path, assets, request, model, more
):
    """The path a run takes: two actor_train ``TrainerWorker`` ranks, each given half of 10 rows in
    micro-batches of 2 rows (3 a rank: the interleaved schedule's groups of 3), a log-prob pass, an SFT
    step and an RL step, at PP=2 x VPP=2 against PP=2; a Qwen3-MoE with its router's load-balancing term
    too. As in ``test_two_stages_of_two_chunks_train_as_two_stages_and_as_one_rank``: the log-prob pass
    and the SFT step's loss (before any step) bit for bit, every other metric (but the throughput)
    within rel 1e-5 (abs 1e-6 for those near zero), weights within 1e-6; a mixture of experts' within
    2 * lr * steps, ``test_a_mixture_of_experts_on_two_stages_of_two_chunks_trains_as_on_two_stages``'
    bound (after the first step a top-k choice may flip at a near tie)."""
    from tests.integration.test_megatron_pipeline import _worker_rank, worker_batch

    cfg_path = request.getfixturevalue(model)
    batch = worker_batch(assets, cfg_path)
    runs = {}
    for name, vp in (("plain", []), ("interleaved", ["strategy.megatron.virtual_pipeline=2"])):
        (tmp_path / name).mkdir()
        runs[name] = run_ranks(_worker_rank, 2, tmp_path / name, str(cfg_path), batch, True, [*more, *vp])
    weights_within = 1e-6 if model == "four_layers" else 2 * LR * 2  # two steps: SFT, RL
    assert all(r["schedules"] == [True, False, False] for r in runs["interleaved"])  # log-probs, SFT, RL
    for a, b in zip(runs["plain"], runs["interleaved"]):
        assert (a["logprobs"] != 0).sum() > 5
        assert torch.equal(b["logprobs"], a["logprobs"])
        assert b["sft"]["sft/loss"] == a["sft"]["sft/loss"]
        for key, prefix in (("sft", "sft"), ("rl", "actor")):
            assert a[key][f"{prefix}/loss"] != 0
            assert model == "four_layers" or a[key][f"{prefix}/router_aux_coef"] == 0.1  # the term ran
            assert b[key].keys() == a[key].keys()
            for metric, value in a[key].items():
                if metric != "train/tokens_per_s":
                    assert b[key][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, metric)
        for name, w in a["weights"].items():
            torch.testing.assert_close(b["weights"][name], w, atol=weights_within, rtol=0)


def _counts_rank(
    rank: int, world_size: int, address: str, out: str, cfg_path: str, sizes: list[str], counts: list[int]
) -> None:
    """For each of ``counts``: that many micro-batches on this rank (of one or two rows, different widths),
    through ``train_micro_batches`` (no optimizer step: the weights stay) and ``score_micro_batches``;
    saves each count's losses and log-probs."""
    from tests.integration.test_megatron_pipeline import _megatron_rank, _Rows, next_token_fns

    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, sizes)
    loss_of, scored = next_token_fns(s, n_tokens)

    saved = {}
    for count in counts:
        mbs = []
        for j in range(count):
            picked = [(rank * 5 + j * 3 + k) % ROWS for k in range(1 + j % 2)]  # 1 or 2 rows
            width = int(mask[picked].sum(-1).max())
            mbs.append(_Rows(ids[picked, :width], mask[picked, :width]))
        losses = [float(v) for v in s.train_micro_batches(mbs, loss_of)]
        with torch.no_grad():
            saved[count] = (losses, [x.cpu() for x in s.score_micro_batches(mbs, scored)])
    torch.save(saved, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory) -> Path:
    return tiny_megatron_config(tmp_path_factory.mktemp("pp4"), 8)


@pytest.mark.long  # 2 x 2 spawned ranks: 25 s on 2 CPU cores; 2 x 4 ranks: minutes each
@pytest.mark.parametrize(
    ("model", "sizes"),
    [
        ("four_layers", ("pipeline_parallel=2",)),
        ("four_layers", ("pipeline_parallel=2", "tensor_parallel=2", "sequence_parallel=true")),
        ("eight_layers", ("pipeline_parallel=4",)),
    ],
    ids=["pp2", "pp2-tp2-sp", "pp4"],
)
def test_any_count_of_micro_batches_runs_interleaved_as_without(tmp_path, request, model, sizes):
    """1 (fillers beside it), 2, 3, 5 and 7 micro-batches a rank, of different rows and widths, at two
    model chunks a stage against one: the interleaved schedule's groups (``interleaved_group``; at PP=2:
    2, 2, 3, 3 and 4) and the shape of every tensor a stage receives (``received_micro_batches``: at
    PP=2 a stage's previous and next are one rank, at PP=4 not; under sequence parallelism a TP rank's
    slice of the sequence) hold for each count, forward and backward: the losses of a training pass and
    the log-probs of a forward-only one equal the plain schedule's bit for bit (the same layers, on the
    same rows in the same shapes; no optimizer step between)."""
    counts = [1, 2, 3, 5, 7]
    cfg_path = request.getfixturevalue(model)
    world_size = 4 if len(sizes) > 1 or model == "eight_layers" else 2
    runs = {}
    for name, more in (("plain", []), ("interleaved", ["virtual_pipeline=2"])):
        (tmp_path / name).mkdir()
        overrides = [f"strategy.megatron.{s}" for s in (*sizes, *more)]
        runs[name] = run_ranks(_counts_rank, world_size, tmp_path / name, str(cfg_path), overrides, counts)
    for a, b in zip(runs["plain"], runs["interleaved"]):
        for count in counts:
            assert len(b[count][0]) == len(b[count][1]) == count  # the fillers' results dropped
            assert a[count][0] == b[count][0], count
            assert all(torch.equal(x, y) for x, y in zip(a[count][1], b[count][1])), count
