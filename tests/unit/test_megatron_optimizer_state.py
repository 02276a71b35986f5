"""The Megatron optimizer state's restore, single-process: Adam's state rebuilt from the layout-free form
(moments and main params put back per parameter, a distributed optimizer's flat range cut out, the step
count set where the optimizer keeps it) steps exactly as the optimizer that was never interrupted. The
multi-rank layouts are ``tests/integration/test_megatron_resume.py``."""

from __future__ import annotations

import torch

from reroll.strategies.megatron_optimizer_state import MAIN, MOMENTS, Slot, _put, _set_step


def _adam(params: list[torch.Tensor]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def _grads(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(step))


def test_adam_rebuilt_from_whole_tensors_steps_as_the_uninterrupted_one():
    """Two steps, the state read out whole; a fresh AdamW over a flat range of the parameter (as the
    distributed optimizer holds it) given its part, and one over the whole parameter: the third step
    is bit for bit the uninterrupted one's (the same elementwise arithmetic on the same numbers)."""
    shape = (6, 5)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(9)).requires_grad_()
    adam = _adam([w])
    for step in range(2):
        w.grad = _grads(step, shape)
        adam.step()
    saved = {MAIN: w.detach().clone()} | {k: adam.state[w][k].clone() for k in MOMENTS}

    whole = w.detach().clone().zero_().requires_grad_()
    flat = torch.zeros(11).requires_grad_()  # elements [7, 18) of the parameter
    restored = [
        (Slot(_adam([whole]), whole), whole),
        (Slot(_adam([flat]), flat, 7, 18, group=object()), flat),
    ]
    for slot, p in restored:
        for kind, t in saved.items():
            _put(slot, kind, t)
        _set_step([slot.inner], {p: slot}, 2)
        assert slot.inner.state[p]["step"].dtype == torch.float32  # as torch's Adam keeps it

    w.grad = _grads(2, shape)
    adam.step()
    for slot, p in restored:
        g = _grads(2, shape)
        p.grad = g if p.shape == shape else g.reshape(-1)[7:18]
        slot.inner.step()
    assert torch.equal(whole, w.detach())
    assert torch.equal(flat, w.detach().reshape(-1)[7:18])
    assert torch.equal(restored[0][0].inner.state[whole]["exp_avg_sq"], adam.state[w]["exp_avg_sq"])


def test_a_fused_adam_gets_its_step_count_per_group():
    """Apex's and Transformer Engine's fused Adam keep the step count in each parameter group."""

    class FusedLike(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-2})

    p = torch.zeros(3, requires_grad=True)
    fused = FusedLike([p])
    _set_step([fused], {p: Slot(fused, p)}, 5)
    assert [g["step"] for g in fused.param_groups] == [5]
    assert "step" not in fused.state[p]
