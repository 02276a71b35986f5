"""Two runs take the same optimizer step: a comparison whose tolerance follows from float32 arithmetic,
so that it holds on any CPU, for runs that differ only in summation order (data-parallel ranks,
micro-batch splits, packing, another strategy, another CPU kernel).

Why not compare AdamW's steps as trained. Its first step moves an element by lr * g / (|g| + eps),
about lr * sign(g): a map whose slope near g = 0 is lr / eps = 1e6 * lr at torch's eps = 1e-8. Summing
in another order moves a gradient by ~1e-7 of its terms, so an element whose terms nearly cancel can
step anywhere in [-lr, lr], and how many elements that hits depends on the CPU's kernels: on one Intel
Xeon 0.9987 of the elements agreed to 1e-6, against 0.999 on our AMD EPYC (issue 39, item 10).

So the tests make the same AdamW take SGD steps: ``use_sgd_steps`` sets Adam's eps to ``EPS`` = 1e3 and
its lr to ``eta * EPS``. A step is then lr * m / (sqrt(v) + eps) = eta * m * (1 - theta), where m, Adam's
bias-corrected first moment, is a weighted mean of the clipped gradients (SGD with momentum; plain SGD
at the first step), and 0 <= theta <= sqrt(v) / eps <= grad_clip / eps <= 1e-3, since no element of a
clipped gradient exceeds grad_clip (<= 1 here). The step is linear in the gradients up to that 1e-3: two
runs' steps differ by at most eta * (1 + 1e-3) times their gradients' difference, where torch's eps
allowed 1e6 * lr times it. All else (the AdamW object, its state and sharding, the lr schedule,
clipping, weight decay given as ``wd / EPS``) runs as in training.

The bound ``assert_same_steps`` checks, per parameter tensor, in norms over its elements:

    |w_b - w_a| <= RTOL * |w_a - w0| + 2 * steps * F32_EPS * |w_a|

- ``F32_EPS * |w|`` = 2**-23 |w|: a step rounds each run's new weights to float32, at most twice (weight
  decay, then the update), half an ulp (<= 2**-24 |w|) each time: 2 * 2**-23 |w| a step for two runs.
- ``RTOL`` = 1e-4: the gradients' relative difference, which the momentum's weighted mean keeps. A
  float32 sum of n terms taken in another order moves by at most about n * 2**-24 of its terms'
  magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2). A weight's
  gradient here comes through a chain of about twenty such reductions (two layers forward and back),
  most of n = 64 terms (3.8e-6 each), a few of up to 256 (a step's tokens, the MLP's width; 1.5e-5):
  about 1e-4 in all. Terms that cancel make an element's error large against the element itself, not
  against the tensor's norm, which the large elements carry. The second step starts from weights that
  already differ by the first's error; its gradient moves by the curvature times that, small for these
  steps (measured: the ``log`` line of each comparison gives the share of the bound used).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

EPS = 1e3  # Adam's eps, far above any clipped gradient element: its step becomes SGD's
RTOL = 1e-4  # the gradients' relative difference across summation orders (module docstring)
F32_EPS = torch.finfo(torch.float32).eps  # 2**-23: float32's spacing relative to the value


def adamw_of(strategy: Any) -> torch.optim.Optimizer:
    """The AdamW a strategy steps: DeepSpeed's over this rank's fp32 partition (``DeepSpeedCPUAdam`` in
    its AdamW mode with ``offload_optimizer``, which reads each group's eps at every step as AdamW
    does), else the strategy's own."""
    engine = getattr(strategy, "engine", None)
    optimizer = engine.basic_optimizer if engine is not None else strategy.optimizer
    cpu_adamw = getattr(optimizer, "adam_w_mode", False) is True  # DeepSpeedCPUAdam(adamw_mode=True)
    assert isinstance(optimizer, torch.optim.AdamW) or cpu_adamw, type(optimizer)
    return optimizer


def sgd_eps(strategy: Any) -> int:
    """Set the strategy's AdamW eps to ``EPS``; returns how many parameter groups took it (the hook
    reached the optimizer). ZeRO-3 fills a group's params only while it steps, so groups are counted."""
    optimizer = adamw_of(strategy)
    for group in optimizer.param_groups:
        group["eps"] = EPS
    return len(optimizer.param_groups)


def on_every_rank(group: Any, fn: Callable[[Any], Any]) -> list[Any]:
    """``fn(worker)`` on each rank's worker of a ``WorkerGroup``: in this process (local backend) or in
    its Ray actor (``__ray_call__``, Ray's call of a function on the actor's instance)."""
    import ray

    from reroll.runtime.actors import LocalHandle

    return [
        fn(h._obj) if isinstance(h, LocalHandle) else ray.get(h.__ray_call__.remote(fn))
        for h in group.handles
    ]


def use_sgd_steps(group: Any, eta: float) -> None:
    """Configure the group's optimizer as training does, with lr ``eta * EPS``, then set each rank's
    eps to ``EPS``: its steps are SGD's with learning rate ``eta`` (module docstring)."""
    group.configure_optimizer(eta * EPS, 0)
    counts = on_every_rank(group, lambda worker: sgd_eps(worker.strategy))
    assert len(counts) == group.world_size and all(n > 0 for n in counts), counts


def assert_same_steps(
    w_a: dict[str, torch.Tensor],
    w_b: dict[str, torch.Tensor],
    w0: dict[str, torch.Tensor],
    *,
    steps: int,
    moved: float = 1e-3,
) -> None:
    """Two runs' weights after ``steps`` SGD steps from ``w0`` agree within the module docstring's
    bound, tensor by tensor; and the steps were real (a weight moved by more than ``moved``), so the
    agreement is not that of two runs that did nothing."""
    assert w_a.keys() == w_b.keys() and w0.keys() <= w_a.keys(), (w_a.keys(), w_b.keys(), w0.keys())
    used = {}  # each tensor's difference as a share of its bound
    for name, start in w0.items():
        step = (w_a[name] - start).norm().item()
        diff = (w_b[name] - w_a[name]).norm().item()
        bound = RTOL * step + 2 * steps * F32_EPS * w_a[name].norm().item()
        assert diff <= bound, f"{name}: |w_b - w_a| = {diff:.3g} > {bound:.3g} (|w_a - w0| = {step:.3g})"
        used[name] = diff / bound if bound else 0.0
    worst = max(used, key=used.__getitem__)
    largest = max((w_a[n] - start).abs().max().item() for n, start in w0.items())
    log.info("same steps: %.2g of the bound used (%s); largest move %.2g", used[worst], worst, largest)
    assert largest > moved, f"the steps moved no weight by more than {largest:.3g}"
