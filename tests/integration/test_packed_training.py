"""Packing and token-budget micro-batching through the real TrainerWorker and CriticWorker (local backend).

Every way of cutting and packing a step's rows must give the same log-probs, loss, gradient norm and
updated weights as fixed micro-batches of padded rows: the losses are normalised by the whole step's
counts, and a packed row attends only within each of its sequences.

The steps compared are SGD steps of the same AdamW (tests/same_step.py says why, and derives the
tolerance): runs that differ in summation order alone agree to float32's bound on any CPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import replace

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.data.packing import length_order, micro_batches, padding_stats
from reroll.data.types import TrainBatch
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.critic import CriticGroup
from reroll.roles.objectives import PolicyGradient
from reroll.roles.trainer import TrainerGroup
from tests.conftest import write_config
from tests.same_step import RTOL, assert_same_steps, use_sgd_steps

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)

LR = 1e-2  # AdamW's, where a step is taken and not compared
ETA = 0.1  # SGD's, where two runs' steps are compared (gradients clipped to norm 1)
BASELINE = ("optim.micro_batch_size=4", "optim.packing=false", "optim.group_by_length=false")
VARIANTS = {
    "packed": ("optim.micro_batch_size=4", "optim.packing=true", "optim.group_by_length=false"),
    "token_budget": ("optim.max_tokens_per_micro_batch=30", "optim.packing=false"),
    "token_budget_packed": ("optim.max_tokens_per_micro_batch=30", "optim.packing=true"),
    "by_length": ("optim.micro_batch_size=4", "optim.group_by_length=true"),
}


@pytest.fixture(scope="module")
def batch(assets) -> TrainBatch:
    """22 prompt + answer rows (6 to 10 tokens), with seeded advantages on the response tokens."""
    samples = load_samples([str(assets["train"])], template="{question}=")[:22]
    b = sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}")
    g = torch.Generator().manual_seed(0)
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    return b


@pytest.fixture(scope="module")
def initial(assets) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(assets["model"])).state_dict()


def _cfg(tmp_path, assets, overrides, *, critic: bool = False) -> RunConfig:
    sections = {"algorithm": {"preset": "ppo"}, "critic": {"lr": LR}} if critic else {}
    path = write_config(tmp_path / "c.yaml", assets, **sections)
    local = ["runtime.backend=local", "roles.critic.torch_threads=1"]
    return load_config(path, RunConfig, [*local, *overrides])


def _actor_step(cfg: RunConfig, batch: TrainBatch):
    group = TrainerGroup("actor_train", cfg, trainable=True)
    use_sgd_steps(group, ETA)
    logprobs = group.compute_logprobs(batch)
    metrics = group.train(batch, PolicyGradient.of(group.cfg))
    weights = group.weight_buckets(1.0).tensors()
    return logprobs, metrics, weights


def _after_step_atol(before: torch.Tensor, after: torch.Tensor) -> float:
    """How far two runs' outputs after their steps may differ: as before a step (1e-5: the same weights
    in another summation order), plus RTOL of what the step moved them, since the two steps differ by
    at most RTOL of their size (tests/same_step.py) and an output moves with the weights to first order."""
    return 1e-5 + RTOL * float((after - before).abs().max())


def test_packed_and_token_budget_steps_equal_fixed_padded_micro_batches(tmp_path, assets, batch, initial):
    lp_a, m_a, w_a = _actor_step(_cfg(tmp_path, assets, BASELINE), batch)
    mask = batch.attention_mask
    # rows of 7-9 tokens: a budget of 30 cuts 3 rows at a time (8 micro-batches), unlike 4 rows (6)
    assert [len(mb) for mb in micro_batches(batch, max_rows=None, max_tokens=30)] == [3] * 7 + [1]
    log.info("baseline: loss %.6f grad_norm %.6f", m_a["actor/loss"], m_a["actor/grad_norm"])
    for name, overrides in VARIANTS.items():
        lp_b, m_b, w_b = _actor_step(_cfg(tmp_path, assets, overrides), batch)
        # fp32 log-probs of the same weights, equal to 1e-5 on real tokens (padding columns are never read)
        torch.testing.assert_close(lp_b[mask], lp_a[mask], atol=1e-5, rtol=0, msg=name)
        assert m_b["actor/loss"] == pytest.approx(m_a["actor/loss"], rel=1e-5), name
        assert m_b["actor/grad_norm"] == pytest.approx(m_a["actor/grad_norm"], rel=1e-5), name
        assert_same_steps(w_a, w_b, initial, steps=1)
        assert m_b["train/tokens_per_s"] > 0 and math.isfinite(m_b["train/tokens_per_s"])
        log.info("%s: loss %.6f grad_norm %.6f", name, m_b["actor/loss"], m_b["actor/grad_norm"])


def test_forward_only_micro_batches_give_the_same_logprobs(tmp_path, assets, batch):
    """optim.logprob_* cut the no-grad passes (reference, old log-probs) differently from training; the
    log-probs are the same, and the passes run as many forwards as the setting says."""

    def score(overrides):
        group = TrainerGroup("actor_train", _cfg(tmp_path, assets, overrides), trainable=True)
        worker = group.handles[0]._obj  # local backend: count the forwards the strategy runs
        forward, calls = worker.strategy.logits, []
        worker.strategy.logits = lambda *a, **k: calls.append(1) or forward(*a, **k)
        return group.compute_logprobs(batch), len(calls)

    want, n = score(BASELINE)
    assert n == 6  # 22 rows, 4 at a time
    mask = batch.attention_mask  # padding columns are never read
    for overrides, forwards in [
        (("optim.logprob_micro_batch_size=22",), 1),
        (("optim.logprob_micro_batch_size=1",), 22),
        (("optim.logprob_max_tokens_per_micro_batch=30", "optim.packing=true"), 8),
        (("optim.group_by_length=true",), 6),  # rows cut longest first, log-probs back in row order
    ]:
        got, n = score((*BASELINE, *overrides))
        assert n == forwards, overrides
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0, msg=str(overrides))


def test_forward_only_passes_on_a_gpu_take_a_training_micro_batchs_memory(tmp_path, assets, batch):
    """With optim.logprob_* unset, a GPU rank cuts forward-only passes by the model's shape
    (``forward_only_limits``: as many rows as hold a training micro-batch's memory), so it runs fewer
    of them than training's micro-batches, with the same log-probs. Here the CPU rank is given the
    shape a GPU rank reads at start; a CPU rank keeps training's cut."""
    from reroll.config.memory import forward_only_limits, model_token_shape

    group = TrainerGroup("actor_train", _cfg(tmp_path, assets, BASELINE), trainable=True)
    worker = group.handles[0]._obj
    assert worker._shape is None  # off GPUs: training's cut
    forward, calls = worker.strategy.logits, []
    worker.strategy.logits = lambda *a, **k: calls.append(1) or forward(*a, **k)
    want = group.compute_logprobs(batch)
    assert len(calls) == 6  # 22 rows, 4 at a time
    worker._shape = model_token_shape(str(assets["model"]))
    rows, tokens = forward_only_limits(worker.cfg, worker._shape, batch.input_ids.shape[1])
    assert tokens is None and rows > 4
    calls.clear()
    got = group.compute_logprobs(batch)
    assert len(calls) == math.ceil(22 / rows) < 6
    mask = batch.attention_mask
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["torch", "fsdp2"])
def test_lora_packed_equals_padded(tmp_path, assets, batch, strategy):
    """LoRA (peft's wrapper around the model) packed as padded: the policy's and the base model's
    (the reference, adapters disabled) log-probs, and the adapters' step."""

    def step(overrides):
        lora = (f"strategy.name={strategy}", "strategy.lora.rank=8", *overrides)
        group = TrainerGroup("actor_train", _cfg(tmp_path, assets, lora), trainable=True)
        use_sgd_steps(group, ETA)
        base = group.compute_logprobs(batch, base_model=True)
        metrics = group.train(batch, PolicyGradient.of(group.cfg))
        return base, group.compute_logprobs(batch), metrics

    base_a, after_a, m_a = step(BASELINE)
    base_b, after_b, m_b = step(VARIANTS["token_budget_packed"])
    mask = batch.attention_mask  # padding columns are never read
    torch.testing.assert_close(base_b[mask], base_a[mask], atol=1e-5, rtol=0)
    assert m_b["actor/loss"] == pytest.approx(m_a["actor/loss"], rel=1e-5)
    assert m_b["actor/grad_norm"] == pytest.approx(m_a["actor/grad_norm"], rel=1e-5)
    assert (after_a[mask] - base_a[mask]).abs().max() > 1e-4  # the adapters moved the policy
    atol = _after_step_atol(base_a[mask], after_a[mask])
    torch.testing.assert_close(after_b[mask], after_a[mask], atol=atol, rtol=0)


def test_deepspeed_packed_equals_padded(tmp_path, assets, batch, initial):
    """DeepSpeed ZeRO-3 (parameters gathered inside the forward) packed as padded."""
    from reroll.strategies import strategy_available

    if not strategy_available("deepspeed"):
        pytest.skip("deepspeed is not installed (pip install 'reroll[deepspeed]')")
    zero3 = ("strategy.name=deepspeed", "strategy.deepspeed.zero_stage=3")
    lp_a, m_a, w_a = _actor_step(_cfg(tmp_path, assets, (*zero3, *BASELINE)), batch)
    lp_b, m_b, w_b = _actor_step(_cfg(tmp_path, assets, (*zero3, *VARIANTS["token_budget_packed"])), batch)
    mask = batch.attention_mask  # padding columns are never read
    torch.testing.assert_close(lp_b[mask], lp_a[mask], atol=1e-5, rtol=0)
    assert m_b["actor/loss"] == pytest.approx(m_a["actor/loss"], rel=1e-5)
    assert m_b["actor/grad_norm"] == pytest.approx(m_a["actor/grad_norm"], rel=1e-5)
    assert_same_steps(w_a, w_b, initial, steps=1)


def test_critic_packed_equals_padded(tmp_path, assets, batch):
    """The critic's values and its step are the same packed (and token-budgeted) as padded."""
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(batch.input_ids.shape, generator=g) * batch.response_mask
    batch = replace(batch, values=torch.zeros(batch.input_ids.shape), returns=returns)

    def step(overrides):
        group = CriticGroup(_cfg(tmp_path, assets, overrides, critic=True))
        use_sgd_steps(group, ETA)
        values = group.compute_values(batch)
        metrics = group.train(batch)
        return values, metrics, group.compute_values(batch)

    v_a, m_a, after_a = step(BASELINE)
    v_b, m_b, after_b = step(VARIANTS["token_budget_packed"])
    assert v_a.abs().max() == 0 and v_b.abs().max() == 0  # a new critic's head starts at zero
    assert m_b["critic/vf_loss"] == pytest.approx(m_a["critic/vf_loss"], rel=1e-5)
    assert m_b["critic/grad_norm"] == pytest.approx(m_a["critic/grad_norm"], rel=1e-5)
    assert after_a.abs().max() > 1e-3  # the step moved the values
    mask = batch.attention_mask  # padding columns are never read
    atol = _after_step_atol(v_a[mask], after_a[mask])
    torch.testing.assert_close(after_b[mask], after_a[mask], atol=atol, rtol=0)


def test_token_budget_and_packing_cut_padding(batch):
    """Padding computed by fixed micro-batches of 8 rows vs a token budget of the same mean size vs packing,
    on rows with a long-tailed length distribution (like RL responses) and on the arithmetic rows."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.empty(256).log_normal_(mean=3.5, std=0.8, generator=g).clamp(4, 512)).long()
    width = int(lengths.max())
    mask = torch.arange(width)[None] < lengths[:, None]
    long_tail = TrainBatch(
        input_ids=mask.long(), attention_mask=mask, response_mask=mask, group_ids=torch.arange(256)
    )
    for name, b in (("long-tailed", long_tail), ("arithmetic", batch)):
        budget = 8 * math.ceil(float(b.attention_mask.sum()) / len(b))
        fixed = padding_stats(micro_batches(b, max_rows=8, max_tokens=None), packed=False)
        dynamic = padding_stats(micro_batches(b, max_rows=None, max_tokens=budget), packed=False)
        packed = padding_stats(micro_batches(b, max_rows=None, max_tokens=budget), packed=True)
        by_length = b.select(length_order(b))
        sorted_ = padding_stats(micro_batches(by_length, max_rows=8, max_tokens=None), packed=False)
        log.info(
            "%s rows, budget %d: fixed %s | budget %s | packed %s | by length %s",
            name, budget, fixed, dynamic, packed, sorted_,
        )  # fmt: skip
        assert fixed["tokens"] == dynamic["tokens"] == packed["tokens"] == sorted_["tokens"]
        assert fixed["tokens"] == int(b.attention_mask.sum())
        assert packed["padding"] == 0
        assert sorted_["padding"] <= fixed["padding"]
        if name == "long-tailed":  # a long row shares its micro-batch with fewer short ones (measured: -16%)
            assert dynamic["padding"] < 0.9 * fixed["padding"]
            # rows of similar length share a micro-batch (measured: -89 %; the few longest rows differ most)
            assert sorted_["padding"] < 0.2 * fixed["padding"]


def test_sharded_ranks_run_equally_many_micro_batches(tmp_path, assets, batch, initial):
    """FSDP2 on 2 ranks (Ray, gloo): a forward is a collective, so ranks whose token budgets give different
    micro-batch counts must be evened out, or the step hangs. The step equals one padded rank's."""
    from reroll.runtime.actors import start_ray

    rows = batch.select(slice(0, 9))  # 4 and 5 rows per rank
    counts = [len(micro_batches(s, max_rows=None, max_tokens=18)) for s in rows.split(2)]
    assert counts == [2, 3]  # the ranks' own cuts differ
    _, m_a, w_a = _actor_step(_cfg(tmp_path, assets, BASELINE), rows)
    start_ray(None)
    sharded = (
        "runtime.backend=ray",
        "runtime.call_timeout_s=120",  # a hang fails the test instead of stalling it
        "strategy.name=fsdp2",
        "roles.actor_train.world_size=2",
        "optim.max_tokens_per_micro_batch=18",
        "optim.packing=true",
    )
    cfg = _cfg(tmp_path, assets, sharded)
    group = TrainerGroup("actor_train", cfg, trainable=True)
    try:
        use_sgd_steps(group, ETA)
        m_b = group.train(rows, PolicyGradient.of(group.cfg))
        w_b = group.weight_buckets(1.0).tensors()
    finally:
        group.shutdown()
    assert m_b["actor/grad_norm"] == pytest.approx(m_a["actor/grad_norm"], rel=1e-5)
    assert_same_steps(w_a, w_b, initial, steps=1)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(BASELINE, id="padded"),
        pytest.param(VARIANTS["token_budget_packed"], marks=pytest.mark.long, id="packed"),
    ],
)
def test_compiled_model_gives_the_same_step(tmp_path, assets, batch, initial, overrides):
    """model.compile (each decoder layer through torch.compile, dynamic shapes) changes nothing but the
    kernels: log-probs, loss, gradient norm and the step equal the eager model's, padded and packed
    (``long``: each variant compiles its own graphs, ~30 s on 2 cores), the state dict keeps the Hugging
    Face names (weight sync and checkpoints read them), and the layers share their compiled graphs."""
    from torch._dynamo.utils import counters

    lp_a, m_a, w_a = _actor_step(_cfg(tmp_path, assets, BASELINE), batch)
    torch._dynamo.reset()
    counters.clear()
    lp_b, m_b, w_b = _actor_step(_cfg(tmp_path, assets, (*overrides, "model.compile=true")), batch)
    if overrides == BASELINE:  # (packed rows on CPU attend row by row: a Python loop dynamo breaks at)
        # the model's decoder layers share their graphs: one for the training pass and one for the
        # log-prob pass, whatever the layer count and the rows' lengths (a graph per layer would be 4)
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert w_b.keys() == w_a.keys()
    mask = batch.attention_mask
    torch.testing.assert_close(lp_b[mask], lp_a[mask], atol=1e-5, rtol=0, msg=str(overrides))
    assert m_b["actor/loss"] == pytest.approx(m_a["actor/loss"], rel=1e-5)
    assert m_b["actor/grad_norm"] == pytest.approx(m_a["actor/grad_norm"], rel=1e-5)
    assert_same_steps(w_a, w_b, initial, steps=1)


def test_teacher_topk_comes_back_in_row_order(tmp_path, assets, batch):
    """A teacher's top-k cut longest first (optim.group_by_length) is put back in the batch's row order."""
    from reroll.roles.teacher import TeacherGroup

    def topk(overrides):
        group = TeacherGroup(_cfg(tmp_path, assets, overrides), "t", str(assets["model"]))
        return group.compute_topk(batch, 3)

    values_a, ids_a = topk(BASELINE)
    values_b, ids_b = topk(VARIANTS["by_length"])
    mask = batch.attention_mask.bool()
    assert torch.equal(ids_b[mask], ids_a[mask])
    torch.testing.assert_close(values_b[mask], values_a[mask], atol=1e-5, rtol=0)


def test_head_at_the_response_positions_equals_the_full_head(tmp_path, assets, batch, initial, monkeypatch):
    """The trainer runs the head at the positions before the response tokens alone: by default the head
    computes their log-probs and entropy itself (``fused_head_at``: its output is ``(1, K)``, no logits),
    else their ``(1, K, V)`` logits (``head_at``, as with ``fused_head`` off). Both give the log-probs,
    loss, entropy, gradient norm and step read off the full head's logits, padded and packed. The logits
    path is what ``model.fused_head: false`` asks for."""
    from reroll.roles import scored_tokens
    from reroll.strategies.torch_strategy import TorchStrategy

    def full_head(model, positions):
        yield False  # as where no single lm_head is found: the whole output, rows taken after

    heads: list[tuple[int, ...]] = []
    for overrides in (BASELINE, VARIANTS["packed"]):
        cfg = _cfg(tmp_path, assets, overrides)
        with monkeypatch.context() as m:
            m.setattr(TorchStrategy, "fused_head", False)
            m.setattr(scored_tokens, "head_at", contextlib.contextmanager(full_head))
            lp_a, m_a, w_a = _actor_step(cfg, batch)
        for fused in ("false", "true"):
            cfg = _cfg(tmp_path, assets, [*overrides, f"model.fused_head={fused}"])
            group = TrainerGroup("actor_train", cfg, trainable=True)
            head = group.handles[0]._obj.strategy.model.get_output_embeddings()
            hook = head.register_forward_hook(lambda _m, _i, out: heads.append(tuple(out.shape)))
            use_sgd_steps(group, ETA)
            lp_b = group.compute_logprobs(batch)
            m_b = group.train(batch, PolicyGradient.of(group.cfg))
            w_b = group.weight_buckets(1.0).tensors()
            hook.remove()
            mask = batch.attention_mask
            torch.testing.assert_close(lp_b[mask], lp_a[mask], atol=1e-5, rtol=0, msg=str(overrides))
            assert m_b["actor/loss"] == pytest.approx(m_a["actor/loss"], rel=1e-5)
            assert m_b["actor/grad_norm"] == pytest.approx(m_a["actor/grad_norm"], rel=1e-5)
            assert m_b["actor/entropy"] == pytest.approx(m_a["actor/entropy"], rel=1e-5)
            assert_same_steps(w_a, w_b, initial, steps=1)
    responses = int(batch.response_mask.sum())
    vocab = head.out_features
    logits = [s for s in heads if len(s) == 3]  # head_at's
    fused = [s for s in heads if len(s) == 2]  # the fused head's log-probs
    assert len(logits) + len(fused) == len(heads)
    for shapes in (logits, fused):  # two passes each, padded and packed
        assert sum(s[1] for s in shapes) == 4 * responses
    assert all(s[0] == 1 and s[2] == vocab for s in logits)
    assert all(s[0] == 1 for s in fused)


def test_a_trainer_keeps_the_widest_micro_batch_it_ran_for_its_memory_need(tmp_path, assets, batch):
    """What ``memory_need`` scales a GPU's measured peak from: the widest micro-batch's tokens a row and
    the longest prompt part of a row, over every pass (here the forward-only and the training pass); off
    GPUs there is no need to report."""
    cfg = _cfg(tmp_path, assets, BASELINE)
    group = TrainerGroup("actor_train", cfg, trainable=True)
    worker = group._handles[0]._obj
    assert worker._widest == (0, 0)
    group.configure_optimizer(LR, 0)
    group.compute_logprobs(batch)
    group.train(batch, PolicyGradient.of(group.cfg))
    widths = [mb.input_ids.shape[1] for mb in micro_batches(batch, max_rows=4, max_tokens=None)]
    prompts = batch.attention_mask.sum(1) - batch.response_mask.sum(1)
    assert worker._widest == (max(widths), int(prompts.max()))
    assert group.memory_need() == (0, 0, 0)
