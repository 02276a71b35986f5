"""Context parallelism (``strategy.context_parallel``, Ulysses): two FSDP2 ranks that split every
sequence between them compute what one rank computes on the whole rows: the log-prob pass, and the
optimizer steps of an SFT, a distillation (full logits gathered) and an RL loss, on padded and on packed
rows, for a model with grouped-query attention (4 heads, 2 key-value heads: one of each per rank).

The two ranks run in processes of their own over gloo, each a ``TrainerWorker`` (what a
``TrainerGroup`` rank runs); the reference is one FSDP2 rank in this process. The steps compared are
SGD steps of the same AdamW, within the float32 bound ``tests/same_step.py`` derives: splitting a
sequence changes only summation orders (a projection's rows computed in two calls, a weight's gradient
summed over two halves of the tokens and then over the ranks).

Log-probs: a token's log-prob is its logit minus a log-sum-exp over the vocabulary, each the end of a
chain of float32 reductions of the kind ``same_step`` counts (about twenty, of up to 256 terms, through
two layers): their relative error is about ``RTOL`` = 1e-4 of the terms' magnitudes, which the logits
(of the size of the log-probs) bound. So ``|cp - one| <= RTOL * max|log-prob|``, elementwise.
"""

from __future__ import annotations

import logging
import socket

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.models.loading import load_causal_lm, load_tokenizer
from reroll.models.tiny import build_tiny_model
from reroll.pipelines.common import sft_batch
from reroll.roles.objectives import Distillation, NextToken, PolicyGradient
from tests.conftest import write_config
from tests.same_step import RTOL, assert_same_steps, sgd_eps

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

ETA = 0.1  # SGD's learning rate (gradients clipped to norm 1)
FSDP2 = ["strategy.name=fsdp2", "optim.micro_batch_size=4", "runtime.backend=local"]
# the split side with activation checkpointing, as the long-row example runs it: each layer's all-to-alls
# run again in the backward pass, where the layer is recomputed
SPLIT = [
    "strategy.context_parallel=2",
    "roles.actor_train.world_size=2",
    "runtime.backend=ray",
    "model.gradient_checkpointing=true",
]


@pytest.fixture(scope="module")
def gqa_config(tmp_path_factory, assets):
    """A config over a tiny model with 4 attention heads and 2 key-value heads."""
    from reroll.data.arithmetic import ARITHMETIC_ALPHABET

    root = tmp_path_factory.mktemp("cp")
    model = build_tiny_model(
        root / "model",
        alphabet=ARITHMETIC_ALPHABET,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        for_cpu_engine=False,
    )
    return write_config(root / "c.yaml", {**assets, "model": model})


@pytest.fixture(scope="module")
def batch(assets, gqa_config):
    samples = load_samples([str(assets["train"])], template="{question}=")[:10]
    b = sft_batch(samples, load_tokenizer(str(load_config(gqa_config, RunConfig).model.path)), "{answer}")
    g = torch.Generator().manual_seed(0)
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    b.teacher_logprobs = -torch.rand(b.response_mask.shape, generator=g) * 3 * b.response_mask
    return b


def _steps(worker, batch) -> dict:
    """Log-probs and steps through ``worker`` as a run takes them: on padded rows a log-prob pass, an
    SFT step and a distillation step; on packed rows a log-prob pass and an RL step."""
    from tests.same_step import EPS

    worker.configure_optimizer(ETA * EPS, 0)
    assert sgd_eps(worker.strategy) > 0
    out = {"padded": worker.compute_logprobs(batch)}
    out["sft"] = worker.train(batch, NextToken())
    out["distill"] = worker.train(batch, Distillation())
    worker.packing = True
    out["packed"] = worker.compute_logprobs(batch)
    out["rl"] = worker.train(batch, PolicyGradient.of(worker.cfg))
    out["weights"] = worker.strategy.full_state_dict()
    return out


def _split_rank(rank: int, address: str, path: str, batch, result_dir: str) -> None:
    """One rank of the context-parallel pair: ``_steps``, and what its attention saw."""
    from reroll.models import ulysses
    from reroll.roles.trainer import TrainerWorker

    seen: list[tuple[int, int]] = []  # (this rank's tokens, the sequence its heads attended over)
    recomputed = []  # calls inside a backward pass (a checkpointed layer run again)
    inner = ulysses.sequence_to_heads

    def counted(x, group):
        out = inner(x, group)
        seen.append((x.shape[2], out.shape[2]))
        if torch._C._current_graph_task_id() != -1:
            recomputed.append(1)
        return out

    ulysses.sequence_to_heads = counted
    cfg = load_config(path, RunConfig, FSDP2 + SPLIT)
    worker = TrainerWorker("actor_train", rank, cfg, True)
    worker.init_distributed(address)
    out = _steps(worker, batch)
    out["attention"] = worker.strategy.hf_model.config._attn_implementation
    torch.save(out | {"seen": seen, "recomputed": len(recomputed)}, f"{result_dir}/rank{rank}.pt")


def test_two_context_parallel_ranks_equal_one(tmp_path, gqa_config, batch):
    import torch.multiprocessing as mp

    from reroll.roles.trainer import TrainerWorker

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{so.getsockname()[1]}"
    pair = mp.start_processes(
        _split_rank,
        args=(address, str(gqa_config), batch, str(tmp_path)),
        nprocs=2,
        start_method="spawn",
        join=False,
    )
    cfg = load_config(gqa_config, RunConfig, FSDP2)
    one = _steps(TrainerWorker("actor_train", 0, cfg, True), batch)  # while the pair starts
    while not pair.join():
        pass
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    # the split ran: every attention call exchanged halves of the sequence, on both ranks, and the
    # training passes' checkpointed layers ran theirs again in the backward pass
    for r in ranks:
        assert r["attention"].startswith("reroll_ulysses"), r["attention"]
        assert r["seen"] and all(n == 2 * s for s, n in r["seen"]), r["seen"][:4]
        assert r["recomputed"] > 0
    # both ranks of the group hold the same results; rank 1 gathered no weights
    for key in ("padded", "packed"):
        assert torch.equal(ranks[0][key], ranks[1][key])
    for key in ("sft", "distill", "rl"):
        same = {k: v for k, v in ranks[0][key].items() if "tokens_per_s" not in k}
        assert same == {k: v for k, v in ranks[1][key].items() if "tokens_per_s" not in k}
    split = ranks[0]

    for key in ("padded", "packed"):
        ref = one[key]
        assert (ref != 0).sum() > 10
        bound = RTOL * float(ref.abs().max())
        torch.testing.assert_close(split[key], ref, rtol=0, atol=bound)
        log.info("%s log-probs: %.2g of the bound used", key, float((split[key] - ref).abs().max()) / bound)
    for key, loss, prefix in (
        ("sft", "sft/loss", "sft"),
        ("distill", "distill/loss", "actor"),
        ("rl", "actor/loss", "actor"),
    ):
        assert split[key][loss] == pytest.approx(one[key][loss], rel=1e-5, abs=1e-7), key
        grad_norm = f"{prefix}/grad_norm"
        assert split[key][grad_norm] == pytest.approx(one[key][grad_norm], rel=1e-5), key
    initial = load_causal_lm(cfg.model.path).state_dict()
    assert_same_steps(one["weights"], split["weights"], initial, steps=3)


@pytest.mark.long
def test_two_groups_of_two_equal_one_rank(tmp_path, gqa_config, batch):
    """The layout a multi-GPU run takes: 4 Ray ranks in 2 context-parallel groups (FSDP2 over all 4, each
    group a data-parallel rank with half the rows) take the same steps as one rank (about 2 min)."""
    from reroll.roles.trainer import TrainerGroup
    from reroll.runtime.actors import start_ray
    from tests.same_step import on_every_rank, use_sgd_steps

    start_ray(None)

    def steps(*overrides: str) -> tuple[torch.Tensor, dict, dict, dict]:
        group = TrainerGroup(
            "actor_train", load_config(gqa_config, RunConfig, [*FSDP2, *overrides]), trainable=True
        )
        try:
            seen = on_every_rank(group, lambda w: w.strategy.hf_model.config._attn_implementation)
            use_sgd_steps(group, ETA)
            logprobs = group.compute_logprobs(batch)
            sft = group.train(batch, NextToken())
            rl = group.train(batch, PolicyGradient.of(group.cfg))
            return logprobs, sft, rl, group.weight_buckets(1.0).tensors() | {"attention": seen}
        finally:
            group.shutdown()

    one = steps()
    four = steps("strategy.context_parallel=2", "roles.actor_train.world_size=4", "runtime.backend=ray")
    assert all(name.startswith("reroll_ulysses") for name in four[3].pop("attention"))
    one[3].pop("attention")
    bound = RTOL * float(one[0].abs().max())
    torch.testing.assert_close(four[0], one[0], rtol=0, atol=bound)
    assert four[1]["sft/loss"] == pytest.approx(one[1]["sft/loss"], rel=1e-5)
    assert four[2]["actor/grad_norm"] == pytest.approx(one[2]["actor/grad_norm"], rel=1e-5)
    assert_same_steps(
        one[3], four[3], load_causal_lm(load_config(gqa_config, RunConfig).model.path).state_dict(), steps=2
    )


@pytest.mark.long
def test_reroll_train_with_context_parallel_equals_one_rank(tmp_path):
    """`reroll train` with roles.actor_train.world_size=2 strategy.context_parallel=2 (2 Ray ranks over gloo)
    logs the steps one fsdp2 rank logs: the same SFT warm start, samples and losses (about 4 min)."""
    from reroll.runtime.metrics import read_metrics
    from tests.conftest import QUICKSTART, quickstart_overrides, reroll_cli, step_metrics

    runs = {}
    for name, extra in (
        ("one", []),
        ("split", ["roles.actor_train.world_size=2", "strategy.context_parallel=2"]),
    ):
        out = tmp_path / name
        args = [
            *quickstart_overrides(tmp_path, 2),
            f"output_dir={out}/{{name}}",
            "sft.steps=2",
            "rollout.batch_size=64",
        ]
        done = reroll_cli("train", QUICKSTART, *args, "strategy.name=fsdp2", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = out / "quickstart"
    resolved = (runs["split"] / "config.yaml").read_text()
    assert "context_parallel: 2" in resolved and "name: fsdp2" in resolved
    assert len(read_metrics(runs["split"])) == 3  # steps 0, 1, 2
    for step in (1, 2):
        one, split = step_metrics(runs["one"], step), step_metrics(runs["split"], step)
        assert split.keys() == one.keys()
        for key, value in one.items():
            assert split[key] == pytest.approx(value, rel=RTOL, abs=1e-7), (step, key)
