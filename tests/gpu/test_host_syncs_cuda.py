"""How often the trainer's passes make the host wait for the GPU, counted by CUDA's sync debug mode
(``torch.cuda.set_sync_debug_mode("warn")``: a warning at every blocking copy, ``.item()``/``float()``,
``nonzero``, mask indexing and stream or device synchronisation).

Through the product's path: ``TrainerWorker.compute_logprobs`` (the reference's and old log-probs'
pass) and ``TrainerWorker.train`` with the GRPO objective (``PolicyGradient``), on packed rows
(``optim.packing`` resolved on a GPU: varlen attention), the logits head (the default) and the fused
one, bf16, the KL to the reference
and the engine's log-probs (``mismatch/*``), with the torch strategy and one FSDP2 rank.

What the host must wait for, and no more (N argued):

- a forward-only pass: 1, its log-probs' one copy to the host at the end (the caller gets CPU tensors);
- a training step: 2, whatever its micro-batches: the gradient norm (``optimizer_step``: whether to step
  depends on it being finite), then every micro-batch's metrics in one copy (after the step is queued,
  when the host has nothing left to queue). 0 inside the micro-batch loop: inputs go to the GPU as
  queued copies from page-locked memory, indices are made on the host from what it has, metrics and
  the non-finite-loss check stay on the GPU.

The test runs each pass at 2 and at 4 micro-batches: the counts must be the same (none a micro-batch)
and at most those numbers. A failure lists where each wait came from (the Python line that made it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.data.types import TrainBatch
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.objectives import PolicyGradient
from tests.conftest import write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

T = TypeVar("T")
MICRO_BATCH = 4
OVERRIDES = [
    "runtime.backend=local",
    "placement.device_type=cuda",
    "placement.devices=1",
    "model.dtype=bfloat16",
    f"optim.micro_batch_size={MICRO_BATCH}",
    "algorithm.kl_coef=0.001",  # the reference's KL in the loss: its term runs
]
LOGPROB_SYNCS = 1  # the pass's one copy of its log-probs to the host
STEP_SYNCS = 2  # the gradient norm (step or skip), then the step's metrics in one copy


def _batch(assets, rows: int) -> TrainBatch:
    """``rows`` prompt + answer rows, with seeded advantages and engine log-probs on the responses."""
    samples = load_samples([str(assets["train"])], template="{question}=")[:rows]
    b = sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}")
    g = torch.Generator().manual_seed(0)
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    b.rollout_logprobs = -torch.rand(b.response_mask.shape, generator=g) * b.response_mask
    return b


def _syncs(fn: Callable[..., T], *args: Any) -> tuple[T, list[str]]:
    """``fn(*args)``, and where it made the host wait for the GPU: one ``file:line`` each (a backward's
    are replayed at the ``backward`` call by autograd)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # a wait reported at the mode switch itself (``set_sync_debug_mode``'s own line) is not the pass's:
    # seen once on an H100 (the torch strategy's first measured pass), in no later call
    return out, [
        f"{w.filename}:{w.lineno}"
        for w in caught
        if "synchronizing" in str(w.message) and not w.filename.endswith(("torch/cuda/__init__.py",))
    ]


@pytest.mark.parametrize("head", ["logits", "fused"])
@pytest.mark.parametrize("strategy", ["torch", "fsdp2"])
def test_the_trainers_passes_wait_for_the_gpu_only_once_or_twice_a_pass(tmp_path, assets, strategy, head):
    from reroll.roles.trainer import TrainerWorker

    path = write_config(tmp_path / "c.yaml", assets)
    fused = f"model.fused_head={head == 'fused'}"
    cfg = load_config(path, RunConfig, [*OVERRIDES, f"strategy.name={strategy}", fused])
    worker = TrainerWorker("actor_train", 0, cfg, True)
    # the product's path ran: a GPU rank, packed rows, the head asked for
    assert worker.strategy.device.type == "cuda" and worker.packing
    assert worker.strategy.fused_head and cfg.model.fused_head == (head == "fused")
    worker.configure_optimizer(1e-5, 0)
    objective = PolicyGradient.of(cfg)

    def passes(batch: TrainBatch) -> dict[str, float]:
        batch.ref_logprobs = worker.compute_logprobs(batch)
        return worker.train(batch, objective)

    for rows in (2 * MICRO_BATCH, 4 * MICRO_BATCH):  # warm-up: CUDA's set-up, the allocators' blocks,
        passes(_batch(assets, rows))  # the optimizer's state, at both widths

    counts = {}
    for rows in (2 * MICRO_BATCH, 4 * MICRO_BATCH):
        batch = _batch(assets, rows)
        assert len(worker.micro_batches(batch)) == rows // MICRO_BATCH
        batch.ref_logprobs, logprob = _syncs(worker.compute_logprobs, batch)
        out, train = _syncs(worker.train, batch, objective)
        # the step ran, with the terms that read the reference's and the engine's log-probs
        assert out["train/nonfinite_skipped"] == 0.0 and {"actor/kl", "mismatch/kl"} <= set(out)
        print(f"{strategy}, {rows // MICRO_BATCH} micro-batches: log-prob pass {logprob}, train step {train}")
        assert len(logprob) <= LOGPROB_SYNCS, f"log-prob pass waited {len(logprob)} times: {logprob}"
        assert len(train) <= STEP_SYNCS, f"train step waited {len(train)} times: {train}"
        counts[rows] = (len(logprob), len(train))
    assert len(set(counts.values())) == 1, f"waits grow with the micro-batches: {counts}"
