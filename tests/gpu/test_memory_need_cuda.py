"""What a trainer on a GPU says it needs (``memory_need``): what ``placement.offload: auto`` weighs
before keeping the vLLM engine awake beside the trainers."""

from __future__ import annotations

import pytest
import torch

from reroll.config.loader import load_config
from reroll.config.schema import RunConfig
from reroll.data.datasets import load_samples
from reroll.models.loading import load_tokenizer
from reroll.pipelines.common import sft_batch
from reroll.roles.objectives import PolicyGradient
from reroll.roles.trainer import TrainerGroup
from reroll.strategies.memory import reserved_peak
from tests.conftest import write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_trainer_needs_its_peak_scaled_to_the_longest_responses(tmp_path, assets):
    path = write_config(tmp_path / "c.yaml", assets, rollout={"max_new_tokens": 64})
    overrides = ["runtime.backend=local", "roles.actor_train.num_gpus_per_worker=1"]
    cfg = load_config(path, RunConfig, overrides)
    samples = load_samples([str(assets["train"])], template="{question}=")[:16]
    batch = sft_batch(samples, load_tokenizer(str(assets["model"])), "{answer}")
    batch.advantages = torch.randn(batch.response_mask.shape) * batch.response_mask
    group = TrainerGroup("actor_train", cfg, trainable=True)
    assert group.memory_need() == (0, 0, 0)  # nothing measured before a pass
    group.configure_optimizer(1e-3, 0)
    group.compute_logprobs(batch)
    group.train(batch, PolicyGradient.of(group.cfg))
    need, rest, total = group.memory_need()
    device = torch.device("cuda", torch.cuda.current_device())
    assert total == torch.cuda.get_device_properties(device).total_memory
    # rows here are ~10 tokens, responses may reach 64 more: the need is above the measured peak
    assert need > reserved_peak(device) > torch.cuda.memory_allocated(device) > 0
    assert rest == torch.cuda.memory_allocated(device)  # its state between phases
    cached_before = torch.cuda.memory_reserved(device)  # the pass's activations' blocks among them
    moved = group.offload()  # to host memory: it takes its state back to the GPU for its next phase
    left, cached = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    assert moved == rest - left > 0  # the bytes reported as offload/bytes
    # the freed blocks left the allocator's cache too: what stays cached is the segments that still hold
    # a live block (cuBLAS's workspaces, ~64 MiB, are allocated through it; small tensors share 2 MiB ones)
    segments = _segments(device)
    assert cached < cached_before and all(in_use for _, in_use, _ in segments), (
        f"cached {cached} of {cached_before}, {left} left; segments (size, allocated, blocks in use): {segments}"
    )
    assert group.memory_need()[1] == rest
    assert group.reload() == pytest.approx(moved, rel=0.01)  # reload/bytes: the same state back
    assert torch.cuda.memory_allocated(device) == pytest.approx(rest, rel=0.01)


def _segments(device: torch.device) -> list[tuple[int, int, list[int]]]:
    """The allocator's segments on ``device``: what keeps memory cached after ``empty_cache``."""
    return [
        (
            seg["total_size"],
            seg["allocated_size"],
            [b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"],
        )
        for seg in torch.cuda.memory_snapshot()
        if seg["device"] == device.index
    ]
