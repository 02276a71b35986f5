"""Sequence parallelism in the Megatron strategy without Transformer Engine (``strategy.megatron.
sequence_parallel`` on Megatron-Core's local spec with ``SequenceParallelRMSNorm``,
``reroll.strategies.megatron_spec``), and a mixture of experts split by sequence (TP x SP, context
parallelism), on CPU ranks over gloo with CUDA calls pointed at the CPU (``tests/integration/
megatron_cpu.py``), each against one rank. All ``-m long``: spawned ranks importing megatron-core; the CI
siblings are ``tests/unit/test_megatron_convert.py::test_the_local_spec_norms_take_sequence_shards_and_
mark_their_weights`` and ``tests/integration/test_pipeline_stages.py``'s column-split router loss.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from reroll.algorithms.logprobs import token_logprobs
from tests.conftest import write_config
from tests.integration.megatron_cpu import run_ranks
from tests.integration.test_megatron_pipeline import (
    LR,
    ROWS,
    STEPS,
    _megatron_rank,
    _run,
    assert_train_as_one,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install 'reroll[megatron]')",
)

ROUTER_COEF = 0.1


def _assets(root: Path) -> dict[str, Path]:
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET
    from reroll.models.tiny import build_tiny_model

    model = build_tiny_model(
        root / "qwen2", alphabet=ARITHMETIC_ALPHABET, hidden_size=64, num_heads=4, for_cpu_engine=False
    )
    data = root / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    return {"model": Path(model), "train": data, "test": data}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Configs of a tiny Qwen2 (qkv bias, tied), a tiny Qwen3 (q/k norms, its own head) and a tiny
    Qwen3-MoE (4 experts, top-2, q/k norms; also over 4 key-value heads), 2 layers, 4 heads over 2
    key-value heads, fp32; weights
    drawn away from their init (norms off 1), so a norm's gradient that misses a rank's tokens shows."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("sp")
    assets = _assets(root)
    vocab = AutoModelForCausalLM.from_pretrained(assets["model"]).config.vocab_size
    shape = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    configs = {
        "qwen3": Qwen3Config(**shape, intermediate_size=128, tie_word_embeddings=False),
        "qwen3_moe": Qwen3MoeConfig(
            **shape, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        ),
        # 4 key-value heads: CP=2 x TP=2 gives each rank one
        "qwen3_moe_kv4": Qwen3MoeConfig(
            **(shape | {"num_key_value_heads": 4}),
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    }
    out = {"qwen2": write_config(root / "qwen2.yaml", assets, model={"path": str(assets["model"]),
                                                                      "dtype": "float32"})}  # fmt: skip
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        model.save_pretrained(root / name)
        out[name] = write_config(root / f"{name}.yaml", assets, model={"path": str(root / name),
                                                                       "dtype": "float32"})  # fmt: skip
    return out


@pytest.mark.long  # three spawned ranks importing megatron-core: 20-30 s each on 2 CPU cores, a minute busy
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_tp2_with_sequence_parallel_trains_as_one_rank(tmp_path, models, name):
    """TP=2 with sequence parallelism on the local spec (no Transformer Engine), each rank given half the
    rows, against one rank on the whole batch: losses (the ranks' summed), the gradient norm, log-probs
    of a forward-only pass after the steps and the weights after ``STEPS`` Adam steps.

    Each norm runs on a rank's half of the sequence and its weight's gradient is summed over the two
    ranks (``finalize_model_grads``); the q/k norms see every token of a rank's heads and are summed
    likewise. What differs from one rank is summation order only: a weight's gradient summed over two
    halves of the tokens then over the ranks, each TP matmul in two parts. So the loss and the norm
    within rel 1e-5 (fp32, ~200 terms: 200 * 2**-24 ~ 1e-5), log-probs within 1e-5, and, as Adam can
    turn rounding in a near-zero gradient into a step of up to lr, weights within 2 * lr * steps (as
    ``test_megatron_pipeline``'s TP bounds; measured: losses and norms to 2e-7, weights to 5e-6). A norm
    whose gradient missed the other rank's tokens (about half of it) would move the gradient norm, which
    counts the norms' gradients, far past rel 1e-5."""
    one = _run(tmp_path, models[name], 1)[0]
    two = _run(tmp_path, models[name], 2, "tensor_parallel=2", "sequence_parallel=true")
    norms = 2 * (4 if name == "qwen3" else 2) + 1  # each layer's two (and q/k) norms, the final one
    assert not one["sequence_parallel"] and all(len(r["sequence_parallel"]) == norms for r in two)
    assert_train_as_one(one, two)


def _routed_rank(
    rank: int,
    world_size: int,
    address: str,
    out: str,
    cfg_path: str,
    sizes: list[str],
    parts: int,
    same_rows: int,
    stride: int = 1,
) -> None:
    """``STEPS`` steps of next-token loss plus the router's load-balancing term as the trainer adds it
    (``StepRouting``, each micro-batch's share its rows over the batch's) on this rank's rows cut into
    ``parts`` micro-batches; ``same_rows`` ranks ``stride`` apart take the same rows (a context-parallel
    group, ``tensor_parallel`` apart, whose columns' logits are gathered as the worker gathers them). Saves per step the next-token loss,
    this rank's router term and the grad norm, the router metrics and the gathered weights."""
    from reroll.models.moe import StepRouting

    s, ids, mask, n_tokens = _megatron_rank(rank, world_size, address, cfg_path, sizes)
    block = (rank // (same_rows * stride)) * stride + rank % stride  # data_shards' order
    mine = ROWS * same_rows // world_size
    first = block * mine
    cuts = [slice(first + i * mine // parts, first + (i + 1) * mine // parts) for i in range(parts)]
    steps, metrics, columns = [], [], []
    for _ in range(STEPS):
        routing, main, router = StepRouting(s.moe_routers, ROUTER_COEF), 0.0, 0.0
        for cut in cuts:
            width = int(mask[cut].sum(-1).max())
            i, m = ids[cut, :width], mask[cut, :width]
            with s.moe_routers.capture() as routed:
                logits = s.logits(i, m)
            columns.append(logits.shape[1])
            if s.context_parallel is not None:  # this rank's columns: the group's gathered
                logits = s.context_parallel.gather(logits, width)
            loss = -(token_logprobs(logits, i) * m).sum() / n_tokens
            term = routing.term(routed, len(i) / ROWS)
            s.backward(loss + term)
            main, router = main + float(loss), router + float(term)
        steps.append((main, router, s.step(1.0)["grad_norm"]))
        metrics.append(routing.metrics("actor"))
    split = s.moe_routers.split is not None and s.moe_routers.split.columns is not None  # a row's slice
    saved = {"steps": steps, "metrics": metrics, "weights": s.full_state_dict(), "split": split}
    saved["columns"] = columns  # the width of each forward's logits: a context-parallel rank's columns
    torch.save(saved, f"{out}/rank{rank}.pt")


def _routed(
    tmp_path: Path, cfg: Path, world_size: int, parts: int, same_rows: int, *sizes: str, stride: int = 1
) -> list[dict]:
    out = tmp_path / f"routed{world_size}_{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    overrides = [f"strategy.megatron.{s}" for s in sizes]
    return run_ranks(_routed_rank, world_size, out, str(cfg), overrides, parts, same_rows, stride)


@pytest.mark.long  # three (five) spawned ranks of a mixture of experts: 30 (50) s on 2 CPU cores, 2 (4) min busy
@pytest.mark.parametrize(
    ("sizes", "world"),
    [(("tensor_parallel=2", "sequence_parallel=true"), 2),
     (("tensor_parallel=2", "sequence_parallel=true", "expert_parallel=2"), 4),
     (("tensor_parallel=2", "sequence_parallel=true", "pipeline_parallel=2"), 4)],
    ids=["tp2-sp", "tp2-sp-ep2", "tp2-sp-pp2"],
)  # fmt: skip
def test_a_mixture_of_experts_at_tp2_with_sequence_parallel_trains_as_one_rank(
    tmp_path, models, sizes, world
):
    """A Qwen3-MoE at TP=2 with sequence parallelism (each rank routes its half of the sequence of the
    group's rows; the experts split over the TP ranks as the dense MLP, the tokens gathered to them), at
    TP=2 x EP=2 on four ranks (two TP groups, each holding 2 of the 4 experts) and at TP=2 x PP=2 (a layer
    a stage, each rank routing its half of the sequence of the model-parallel group's rows through its
    stage's layer), each rank given its share of the rows, against one rank taking the same shares as
    micro-batches: the router loss of a rank is its own rows' over every column and layer
    (``SplitRouted``: what data-parallel ranks compute), so the ranks' router terms add up to the one
    rank's, and each rank reports its rows' loss.

    The one rank runs fewer rows a forward than a TP group, with other padding, so sums differ by
    rounding: losses, router terms and the norm within rel 1e-5 (fp32, a few hundred terms), the
    router's mean loss within rel 1e-5 (a top-k choice flips only at a near tie), weights within
    2 * lr * steps (Adam on near-zero gradients), as the pipeline-stage MoE test. Measured: losses, router
    terms and norms to 2e-7; weights to 3e-6 (TP=2), 2e-5 (TP=2 x EP=2)."""
    one = _routed(tmp_path, models["qwen3_moe"], 1, world, 1)[0]
    split = _routed(tmp_path, models["qwen3_moe"], world, 1, 1, *sizes)
    assert one["metrics"][0]["actor/router_aux_loss"] > 0 and one["steps"][0][1] > 0
    assert not one["split"] and all(r["split"] for r in split)
    for step, (loss, router, norm) in enumerate(one["steps"]):
        assert sum(r["steps"][step][0] for r in split) == pytest.approx(loss, rel=1e-5)
        assert sum(r["steps"][step][1] for r in split) == pytest.approx(router, rel=1e-5)
        assert all(r["steps"][step][2] == pytest.approx(norm, rel=1e-5) for r in split)
        aux = [r["metrics"][step]["actor/router_aux_loss"] for r in split]
        assert sum(aux) / world == pytest.approx(one["metrics"][step]["actor/router_aux_loss"], rel=1e-5)
    for key, w in one["weights"].items():
        assert all(torch.equal(split[0]["weights"][key], r["weights"][key]) for r in split), key
        torch.testing.assert_close(split[0]["weights"][key], w, atol=2 * LR * STEPS, rtol=0)


@pytest.mark.long  # three (five) spawned ranks of a mixture of experts: 35 s (a minute) on 2 CPU cores
@pytest.mark.parametrize("pp", [1, 2], ids=["cp2", "cp2-pp2"])
def test_a_mixture_of_experts_with_context_parallel_trains_as_one_rank(tmp_path, models, pp):
    """A Qwen3-MoE at CP=2: both ranks of a group take the same rows (two micro-batches), each routes its
    half of the columns, against one rank on the same micro-batches; and at CP=2 x PP=2 (two groups, a
    layer a stage, each half the rows). Each rank computes its rows' whole next-token loss (its columns'
    logits gathered) and the part of the router term its columns (and layers) owe; Megatron's DDP sums
    a group's gradients (they are its data-parallel ranks). So the groups' next-token losses add up to
    the one rank's, the ranks' router terms too, and the router metrics average to its; same tolerances
    as TP=2 (measured at CP=2: losses bit-equal, router terms to 1e-8, norms to 5e-8, weights to 3e-7)."""
    world = 2 * pp
    one = _routed(tmp_path, models["qwen3_moe"], 1, 2 * pp, 1)[0]
    two = _routed(tmp_path, models["qwen3_moe"], world, 2, 2, "context_parallel=2", f"pipeline_parallel={pp}")
    assert all(r["split"] for r in two)
    leaders = two[::2]  # a group's ranks are consecutive (tensor_parallel 1): each computes its rows' loss
    for step, (loss, router, norm) in enumerate(one["steps"]):
        assert sum(r["steps"][step][0] for r in leaders) == pytest.approx(loss, rel=1e-5)
        assert sum(r["steps"][step][1] for r in two) == pytest.approx(router, rel=1e-5)
        assert all(r["steps"][step][2] == pytest.approx(norm, rel=1e-5) for r in two)
        aux = [r["metrics"][step]["actor/router_aux_loss"] for r in two]
        assert sum(aux) / world == pytest.approx(one["metrics"][step]["actor/router_aux_loss"], rel=1e-5)
    for key, w in one["weights"].items():
        assert all(torch.equal(two[0]["weights"][key], r["weights"][key]) for r in two), key
        torch.testing.assert_close(two[0]["weights"][key], w, atol=2 * LR * STEPS, rtol=0)


@pytest.mark.long  # five spawned ranks of a mixture of experts: about a minute on 2 CPU cores
def test_a_mixture_of_experts_at_cp2_x_tp2_with_sequence_parallel_trains_as_one_rank(tmp_path, models):
    """A Qwen3-MoE at CP=2 x TP=2 with sequence parallelism on four ranks: a context-parallel group's two
    ranks (two apart) take the same rows, each TP rank its own, two micro-batches; a CP rank's columns of
    its TP group's rows are scattered again over its TP ranks, padded to a multiple of 4 (the second
    micro-batch's widest row, 18 tokens, runs at 20), so each rank routes a quarter of the columns, and
    the router term pools the four ranks' counts (``SplitRouted`` over the CP x TP column group). Against
    one rank on the same micro-batches: the CP leaders' next-token losses add up to its, the four ranks'
    router terms too, the router metrics average to its; tolerances as the TP=2 with SP test (sums in
    another order: rel 1e-5 in fp32; weights within 2 * lr * steps, Adam on near-zero gradients)."""
    from reroll.strategies.context_parallel import group_leaders

    one = _routed(tmp_path, models["qwen3_moe_kv4"], 1, 4, 1)[0]
    sizes = ("context_parallel=2", "tensor_parallel=2", "sequence_parallel=true")
    split = _routed(tmp_path, models["qwen3_moe_kv4"], 4, 2, 2, *sizes, stride=2)
    assert one["metrics"][0]["actor/router_aux_loss"] > 0 and one["steps"][0][1] > 0
    assert all(r["split"] for r in split)
    assert all(r["columns"] == [12, 10] * STEPS for r in split)  # a CP rank's half of 24, of 18 padded to 20
    leaders = group_leaders(split, 2, 2)  # each computes its rows' whole next-token loss
    for step, (loss, router, norm) in enumerate(one["steps"]):
        assert sum(r["steps"][step][0] for r in leaders) == pytest.approx(loss, rel=1e-5)
        assert sum(r["steps"][step][1] for r in split) == pytest.approx(router, rel=1e-5)
        assert all(r["steps"][step][2] == pytest.approx(norm, rel=1e-5) for r in split)
        aux = [r["metrics"][step]["actor/router_aux_loss"] for r in split]
        assert sum(aux) / 4 == pytest.approx(one["metrics"][step]["actor/router_aux_loss"], rel=1e-5)
    for key, w in one["weights"].items():
        assert all(torch.equal(split[0]["weights"][key], r["weights"][key]) for r in split), key
        torch.testing.assert_close(split[0]["weights"][key], w, atol=2 * LR * STEPS, rtol=0)
