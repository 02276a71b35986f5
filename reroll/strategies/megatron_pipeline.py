"""Pipeline parallelism for the Megatron strategy: a ``GPTModel`` per stage, driven through the same
``logits`` -> loss -> ``backward`` calls as every other strategy.

The ranks of one model-parallel group (``tensor_parallel x pipeline_parallel``) gather their rows and
run them together, as the TP ranks of a group do. Stage ``p`` receives the hidden states of stage
``p - 1`` (``[s, b, h]``, sequence-split under sequence parallelism), runs its layers and sends its
output on; the last stage computes the logits and sends each rank of its pipeline group that rank's
own rows, so every rank computes the loss of its rows as without pipelining. Backward runs the same
way in reverse, driven by autograd: each rank's logits' gradient goes to the last stage (summed there
over the TP group, as ``_SumGradOverGroup`` does without pipelining), the last stage backpropagates
through its layers and sends the gradient of its input to the stage before, and so on to the first.

A micro-batch crosses the stages one after the other (no 1F1B interleaving of micro-batches: the
trainer computes each micro-batch's loss from its logits, so Megatron-Core's
``get_forward_backward_func`` schedule, which owns the loss, does not fit this interface); a stage idles
while the others run, and pipelining buys memory (1/pp of the layers and their optimizer state per
rank), not speed. Every rank of a group must make the same ``logits``/``backward`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Pipeline:
    """This rank's place in its pipeline group: ``ranks`` are the group's global ranks by stage."""

    stage: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup
    tp_group: dist.ProcessGroup | None  # the last stage sums the logits' gradient over it (TP > 1)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == len(self.ranks) - 1

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's output; its gradient goes back there in backward (when grad is on)."""
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, self.ranks[self.stage - 1])
        if not torch.is_grad_enabled():
            return x
        return _FromPreviousStage.apply(x.requires_grad_(), self)

    def output(
        self,
        out: torch.Tensor,
        spans: list[tuple[int, int]],
        logits_shape: tuple[int, int],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """This rank's rows' logits ``(rows, t, V)``: ``out`` is the last stage's logits of the group's rows
        (``spans[p]``: the ``(first row, rows)`` of stage ``p``'s rank), or another stage's hidden states,
        sent on to the next stage. ``logits_shape``: ``(t, V)``."""
        return _StageOutput.apply(out, self, spans, logits_shape, dtype)


class _FromPreviousStage(torch.autograd.Function):
    """Identity forward; backward sends the gradient to the previous stage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pipe: Pipeline) -> torch.Tensor:  # type: ignore[override]
        ctx.pipe = pipe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        dist.send(grad.contiguous(), ctx.pipe.ranks[ctx.pipe.stage - 1])
        return None, None


class _StageOutput(torch.autograd.Function):
    """Last stage: hand each rank of the pipeline group its rows' logits; others: send the hidden states on
    and receive this rank's logits. Backward brings the logits' gradients back to the last stage."""

    @staticmethod
    def forward(ctx, out, pipe, spans, logits_shape, dtype):  # type: ignore[override]
        ctx.pipe, ctx.spans, ctx.out_shape, ctx.out_dtype = pipe, spans, out.shape, out.dtype
        start, rows = spans[pipe.stage]
        if pipe.last:
            for stage, (first, n) in enumerate(spans[:-1]):
                dist.send(out[first : first + n].contiguous(), pipe.ranks[stage])
            return out[start : start + rows].clone()
        dist.send(out.contiguous(), pipe.ranks[pipe.stage + 1])
        mine = torch.empty((rows, *logits_shape), dtype=dtype, device=out.device)
        dist.recv(mine, pipe.ranks[-1])
        return mine

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        pipe, spans = ctx.pipe, ctx.spans
        grad = grad.contiguous()
        if not pipe.last:
            dist.send(grad, pipe.ranks[-1])
            back = torch.empty(ctx.out_shape, dtype=ctx.out_dtype, device=grad.device)
            dist.recv(back, pipe.ranks[pipe.stage + 1])
            return back, None, None, None, None
        full = grad.new_zeros(ctx.out_shape)
        for stage, (first, n) in enumerate(spans):
            if stage == pipe.stage:
                full[first : first + n] = grad
            else:
                dist.recv(full[first : first + n], pipe.ranks[stage])  # rows are contiguous views
        if pipe.tp_group is not None:
            dist.all_reduce(full, group=pipe.tp_group)
        return full, None, None, None, None


def broadcast_from(
    part: dict[str, torch.Tensor] | None, stage: int, pipe: Pipeline, device: torch.device
) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s ``part`` (given there, on CPU; None elsewhere) on every rank of the pipeline group,
    on CPU: names and shapes, then each tensor, broadcast through ``device``."""
    src, mine = pipe.ranks[stage], stage == pipe.stage
    layout = [[(k, tuple(v.shape), v.dtype) for k, v in part.items()] if mine and part is not None else None]
    dist.broadcast_object_list(layout, src=src, group=pipe.group, device=device)
    out = {}
    for name, shape, dtype in layout[0]:
        buf = (
            part[name].to(device)
            if mine and part is not None
            else torch.empty(shape, dtype=dtype, device=device)
        )
        dist.broadcast(buf, src=src, group=pipe.group)
        out[name] = part[name] if mine and part is not None else buf.cpu()
    return out
