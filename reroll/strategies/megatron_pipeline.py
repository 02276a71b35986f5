"""Pipeline parallelism for the Megatron strategy: a ``GPTModel`` per stage (per model chunk under a
virtual pipeline), its micro-batches run by Megatron-Core's 1F1B schedule (interleaved over the chunks)
where the strategy is handed a step's micro-batches together (``run_schedule``), else driven through the
same ``logits`` -> loss -> ``backward`` calls as every other strategy (not under a virtual pipeline).

The ranks of one model-parallel group (``tensor_parallel x pipeline_parallel``) gather their rows and
run them together, as the TP ranks of a group do. Stage ``p`` receives the hidden states of stage
``p - 1`` (``[s, b, h]``, sequence-split under sequence parallelism), runs its layers and sends its
output on.

Scheduled (``MegatronStrategy.train_micro_batches`` and ``score_micro_batches``, which the trainer
calls with all micro-batches of a step or a forward-only pass and the function of each one's loss or
output): each micro-batch's rows are gathered over the model-parallel group first, every rank's
micro-batches go to the last stage of its pipeline group, and Megatron-Core's
``forward_backward_pipelining_without_interleaving`` runs them, shapes exchanged per micro-batch
(``variable_seq_lengths``): ``p - 1 - stage`` warm-up forwards, then one forward and one backward in
turn, then the cool-down backwards, so with ``m`` micro-batches on ``p`` stages a step takes about
``(m + p - 1) / (m p)`` of the time one micro-batch after another takes. The last stage computes every
member's loss from that member's rows' logits (the strategy's ``logits``, called inside the loss,
hands them over) and backpropagates their sum: each member's rows get the gradient of its own loss,
as before; the losses' records (metrics) go back to their ranks at the end. The weights' gradients
accumulate over the micro-batches in the same order as one after the other, so both give the same
gradients bit for bit (``tests/integration/test_megatron_pipeline.py``). A mixture of experts' router
term, which pools every stage's layers, is added by each stage to its own output, the other stages'
top-k counts gathered asynchronously after each forward (``megatron_moe.ScheduledRouting``), where one
after the other each rank adds it inside its loss (``megatron_moe.SplitRouted``). Rows split by context
parallelism are not scheduled.

One after the other (``logits`` and ``backward``): the last stage computes the logits and sends each
rank of its pipeline group that rank's own rows, so every rank computes the loss of its rows as without
pipelining. Backward runs the same way in reverse, driven by autograd: each rank's logits' gradient goes
to the last stage (summed there over the TP group, as ``_SumGradOverGroup`` does without pipelining),
the last stage backpropagates through its layers and sends the gradient of its input to the stage
before, and so on to the first. A stage idles while the others run: this way pipelining buys memory
(1/pp of the layers and their optimizer state per rank), not speed. Every rank of a group must make
the same calls.

Virtual pipeline (``strategy.megatron.virtual_pipeline`` = ``vp`` > 1): each stage holds ``vp`` model
chunks, a ``GPTModel`` each (``vp_stage``; the embedding on stage 0's chunk 0, the final norm and head
on the last stage's last chunk), chunk ``c`` of stage ``p`` the ``(c pp + p)``-th run of
``num_layers / (pp vp)`` layers (``megatron_convert.virtual_stage_layers``, Megatron-Core's own
assignment; ``layer_owner`` the inverse), so a micro-batch crosses the stages ``vp`` times. Each chunk
is wrapped in DDP, the optimizer and ``finalize_model_grads`` take the list; weights load per chunk
(``rank_from_hf(..., chunk, vp)``), go out over every chunk (``megatron_weights.hf_weights`` with
``Groups.vp``), and the optimizer state saves and resumes per chunk in the layout-free form, so a
checkpoint moves between virtual and plain layouts; offload covers every chunk's buffers. The step's
micro-batches run by Megatron-Core's ``forward_backward_pipelining_with_interleaving`` (chosen by
``get_forward_backward_func`` from ``parallel_state``'s virtual size), given the list of chunks and a
data iterator per chunk (``run_schedule``); the loss is computed on the last stage's last chunk. It runs
each chunk's micro-batches in groups (``interleaved_group``: the smallest that Megatron-Core takes for
the count) and needs at least ``pp`` of them (fewer get ``fillers``: one-token micro-batches whose loss
is ``0 x logits``, exact zero gradients). Each micro-batch keeps its own shape: the schedule's exchange
is told every received tensor's shape from the gathered rows, in the order the neighbour sends them
(``known_shapes_exchange``, ``received_micro_batches``; Megatron-Core's own exchange of shapes swaps or deadlocks
at two stages), tensors sent unbatched. A weight's gradient accumulates over the micro-batches in the
same order as at ``vp = 1``, so the first step's losses equal the plain schedule's bit for bit and the
rest within rounding (the gradient norm's sums per stage); ``tests/integration/
test_megatron_virtual_pipeline.py``. A mixture of experts' router term pools every chunk of every
stage: each chunk adds its part to its output, its top-k counts gathered after its forward
(``megatron_moe.ScheduledRouting``, told the micro-batch and chunk), so it trains as at ``vp = 1``
(the first step bit for bit). A dense model under context parallelism is scheduled too: a group's
ranks run the same schedule in step, and the last stage's ranks gather their columns inside the loss
(``tests/integration/test_megatron_context.py``). Outside the schedule (``logits`` one call at a
time, and a mixture of experts under context parallelism, whose micro-batches run one after the other)
a micro-batch goes through every chunk in turn, each chunk's output handed round the ring of stages
(``Pipeline.pass_on``). Left: a mixture of experts under context parallelism scheduled, the uneven
first and last stages Megatron-Core allows with chunks, Megatron-Core's overlapped exchange
(``overlap_p2p_comm``), and a run on GPUs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

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

    def pass_on(self, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A virtual pipeline's chunk output ``out`` sent to the next stage (the last stage's to the
        first, whose next chunk takes it), and this stage's next chunk's input (``shape``) received from
        the previous stage (the first stage's from the last); backward sends the input's gradient back
        and receives the output's. One micro-batch at a time, unscheduled (``MegatronStrategy._pipelined``)."""
        return _PassOn.apply(out, self, shape, dtype)

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


class _PassOn(torch.autograd.Function):
    """``Pipeline.pass_on``: forward sends on and receives the next chunk's input; backward the reverse,
    each to the neighbour it came from (the stages form a ring across chunks)."""

    @staticmethod
    def forward(ctx, out, pipe, shape, dtype):  # type: ignore[override]
        stages = len(pipe.ranks)
        ctx.pipe, ctx.out_shape, ctx.out_dtype = pipe, out.shape, out.dtype
        ctx.after, ctx.before = pipe.ranks[(pipe.stage + 1) % stages], pipe.ranks[pipe.stage - 1]
        dist.send(out.contiguous(), ctx.after)
        x = torch.empty(shape, dtype=dtype, device=out.device)
        dist.recv(x, ctx.before)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dist.send(grad.contiguous(), ctx.before)
        back = torch.empty(ctx.out_shape, dtype=ctx.out_dtype, device=grad.device)
        dist.recv(back, ctx.after)
        return back, None, None, None


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


# -- a step's micro-batches, scheduled 1F1B over the stages ------------------------------------------


@dataclass(frozen=True)
class GroupRows:
    """One micro-batch of the model-parallel group: its gathered rows ``rows`` (right-padded to the
    widest; ``mask`` their real tokens; ``rows_of``: each group rank's count), what the ``GPTModel`` runs
    for them (``ids``, ``positions``, ``causal``; ``t``: the output's columns that are the rows') and
    ``spans``: each stage's rank's ``(first row, rows)`` among them."""

    rows: torch.Tensor
    mask: torch.Tensor
    rows_of: list[int]
    ids: torch.Tensor
    positions: torch.Tensor
    causal: torch.Tensor | None
    t: int
    spans: list[tuple[int, int]]


def run_schedule(
    pipe: Pipeline,
    models: list[torch.nn.Module],
    group_rows: list[GroupRows],
    batches: Sequence[Any],
    fn: Callable[[Any], Any],
    stage_forward: Callable[[GroupRows, int, int], torch.Tensor],
    hand: Callable[[Handed | None], None],
    *,
    forward_only: bool,
    shapes: Sequence[tuple[int, ...]] = (),
) -> list[Any]:
    """``fn`` of this rank's micro-batches ``batches`` (``group_rows``: the group's rows of each), the
    stages running them by Megatron-Core's 1F1B schedule, interleaved over the model chunks ``models``
    where a stage holds more than one (``stage_forward(rows, i, chunk)``: chunk ``chunk``'s output for
    micro-batch ``i``, of rows ``rows``); its
    results in order: each micro-batch's record (training: ``fn(mb) -> (loss, record)``, the loss
    backpropagated) or output (``forward_only``).

    The last stage runs ``fn`` for every rank of its pipeline group: their micro-batches come to it
    first, and the results go back at the end (tensors on the host). Inside ``fn``, the strategy's
    ``logits`` hands over the last stage's logits of that rank's rows (``hand``; the call must be for
    the micro-batch's own ``input_ids``); the members' losses are summed, so each rank's rows' logits get
    the gradient of that rank's loss, as without the schedule. ``group_rows`` past ``batches`` are
    fillers (``fillers``): run, their loss ``0 * logits`` (exact zero gradients), no result. ``shapes``:
    the hidden states' shape of each micro-batch, which the interleaved schedule's exchange is told
    (``known_shapes_exchange``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    members = _to_last_stage(list(batches), pipe)  # the last stage: every member's; others: None
    results: list[list[Any]] = [[] for _ in pipe.ranks]
    real = len(batches)

    def step(data: Iterator[tuple[int, int]], chunk_model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        chunk, i = next(data)
        return stage_forward(group_rows[i], i, chunk), partial(_loss, i)

    def _loss(i: int, logits: torch.Tensor, non_loss_data: bool = False) -> Any:
        assert members is not None  # the last stage('s last chunk)
        g, total = group_rows[i], None
        if i >= real:  # a filler: every weight's gradient gets exact zeros
            zero = torch.zeros((), dtype=torch.int, device=logits.device)
            return None if forward_only else (logits.sum() * 0, zero, None)
        for member, (first, n) in enumerate(g.spans):
            hand(Handed(logits[first : first + n], g.rows[first : first + n]))
            try:
                out = fn(members[member][i])
            finally:
                hand(None)
            if forward_only:
                results[member].append(out)
                continue
            loss, record = out
            results[member].append(record)
            total = loss if total is None else total + loss
        if forward_only:
            return None
        return total, torch.zeros((), dtype=torch.int, device=logits.device), None

    config = get_model_config(models[0])
    count, exchange = len(group_rows), {}
    # micro-batches differ in rows and width: the plain schedule exchanges their shapes first, the
    # interleaved one is told them (``known_shapes_exchange``)
    config.variable_seq_lengths = len(models) == 1
    if len(models) > 1:  # each chunk runs the micro-batches in groups of this many, in order
        group = interleaved_group(count, len(pipe.ranks))
        config.microbatch_group_size_per_vp_stage = group
        exchange = known_shapes_exchange(config, shapes, group, len(models), forward_only=forward_only)
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter([(chunk, i) for i in range(count)]) for chunk in range(len(models))],
        model=models,
        num_microbatches=count,
        seq_length=1,  # ignored: variable_seq_lengths, or the shapes the exchange is told
        micro_batch_size=1,
        forward_only=forward_only,
        collect_non_loss_data=forward_only,
        **exchange,
    )
    if exchange:
        _all_received(exchange["p2p_communicator"])
    return _from_last_stage(results if pipe.last else None, pipe)


def received_micro_batches(
    table: Sequence[tuple[int, int]], stage: int, pp: int, vp: int
) -> tuple[list[int], list[int]]:
    """The micro-batches whose tensors stage ``stage`` receives under the interleaved schedule, in the
    order they come: activations from the previous stage, gradients from the next. ``table``: the
    schedule's ``(micro-batch, model chunk)`` of each forward step, every stage taking the same steps in
    that order (Megatron-Core's ``get_schedule_table``); backward step ``k`` runs chunk ``vp - 1 - c``
    of the table's ``k``-th entry. A stage sends each forward's output on, but the last stage's last
    chunk's, and each backward's input gradient back, but the first stage's first chunk's, in the order
    it runs them; the neighbour receives them in that order (the exchange between two ranks keeps it)."""
    before, after = (stage - 1) % pp, (stage + 1) % pp
    forward = [mb for mb, chunk in table if not (before == pp - 1 and chunk == vp - 1)]
    backward = [mb for mb, chunk in table if not (after == 0 and vp - 1 - chunk == 0)]
    return forward, backward


@cache
def _known_shapes_class() -> type:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, _p2p_ops

    class _KnownShapes(P2PCommunicator):
        """Megatron-Core's point-to-point exchange for the interleaved schedule, told each received
        tensor's shape (``known_shapes_exchange``)."""

        def __init__(self, pp_group: dist.ProcessGroup, config: Any, forward: list, backward: list) -> None:
            super().__init__(pp_group=pp_group, config=config)
            self.forward, self.backward = deque(forward), deque(backward)

        def _communicate(  # type: ignore[override]
            self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs=True
        ):
            dtype, device = self.config.pipeline_dtype, torch.cuda.current_device()
            received = [
                torch.empty(queue.popleft(), requires_grad=True, device=device, dtype=dtype)
                if wanted
                else None
                for wanted, queue in ((recv_prev, self.forward), (recv_next, self.backward))
            ]
            reqs = _p2p_ops(
                tensor_send_prev=tensor_send_prev, tensor_recv_prev=received[0],
                tensor_send_next=tensor_send_next, tensor_recv_next=received[1], group=self.pp_group,
                prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank,
            )  # fmt: skip
            if wait_on_reqs:
                for req in reqs.values():
                    req.wait()
                reqs = None
            return received[0], received[1], reqs

    return _KnownShapes


def known_shapes_exchange(
    config: Any, shapes: Sequence[tuple[int, ...]], group: int, vp: int, *, forward_only: bool
) -> dict[str, Any]:
    """``forward_backward_pipelining_with_interleaving``'s ``p2p_communicator`` and ``pg_collection`` for
    micro-batches of hidden-state ``shapes``, each chunk running them in groups of ``group``: Megatron-
    Core's own exchange, but told each received tensor's shape (``received_micro_batches``) where its
    ``variable_seq_lengths`` would exchange them.

    That exchange is broken here: the schedule's steady state may send both ways at once, and a rank's
    calls need not pair with its neighbour's (a receive posted in one call is met by a send in the
    neighbour's later call). Shapes are exchanged first, batched and waited for within each call; at two
    stages, where a rank's previous and next stage are one rank, the batch [send to previous, receive
    from previous, send to next, receive from next] hands the peer's first receive from this rank (the
    activation's shape) this rank's first send (the gradient's); split by direction, it waits on a
    receive the neighbour posts a call later while that neighbour waits for this rank's tensor (both
    seen on two CPU ranks over gloo). The tensors go by Megatron-Core's unbatched exchange (as
    Megatron-LM runs a virtual pipeline), which orders the two directions by rank parity and at two
    stages puts them on two process groups."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_schedule_table
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.use_mpu_process_groups(["tp", "cp", "embd", "pos_embd", "pp", "dp_cp"])
    table = get_schedule_table(len(shapes), vp, group)
    stage, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    forward, backward = received_micro_batches(table, stage, pp, vp)
    backward = [] if forward_only else backward
    told = _known_shapes_class()(
        groups.pp, config, [shapes[i] for i in forward], [shapes[i] for i in backward]
    )
    return {"p2p_communicator": told, "pg_collection": groups}


def _all_received(exchange: Any) -> None:
    """A ``known_shapes_exchange`` after its schedule: every shape it was told was received, or the order
    ``received_micro_batches`` gives is not the schedule's."""
    left = len(exchange.forward), len(exchange.backward)
    if left != (0, 0):
        raise RuntimeError(
            f"the interleaved schedule received {left[0]} activations and {left[1]} gradients fewer than "
            "received_micro_batches expects: its order is not Megatron-Core's"
        )


def interleaved_group(micro_batches: int, pp: int) -> int:
    """How many micro-batches each model chunk runs in a row under the interleaved schedule
    (``microbatch_group_size_per_vp_stage``): the fewest (the least memory: the warm-up holds ``(vp - 1)
    x`` that many micro-batches' activations) that Megatron-Core takes for ``micro_batches`` over ``pp``
    stages: at least ``pp``, and a last group of none or at least ``pp``. ``micro_batches`` must be at
    least ``pp`` (``fillers``)."""
    if micro_batches < pp:
        raise ValueError(f"the interleaved schedule needs at least {pp} micro-batches, got {micro_batches}")
    return next(g for g in range(pp, micro_batches + 1) if micro_batches % g in (0, *range(pp, g)))


def fillers(micro_batches: int, pp: int, vp: int) -> int:
    """How many empty micro-batches the interleaved schedule (``vp`` > 1) needs beside ``micro_batches``
    over ``pp`` stages: it runs no fewer than ``pp``."""
    return max(pp - micro_batches, 0) if vp > 1 else 0


@dataclass(frozen=True)
class Handed:
    """The last stage's ``logits`` of one member's ``rows`` (the group's, right-padded to the widest),
    handed to the strategy while a scheduled ``fn`` runs: called with ``input_ids``, they are cut to its
    width, what the strategy's ``logits(input_ids, ...)`` returns there."""

    logits: torch.Tensor
    rows: torch.Tensor

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows, width = self.rows, input_ids.shape[1]
        if input_ids.shape[0] != rows.shape[0] or not torch.equal(input_ids.to(rows.device), rows[:, :width]):
            raise RuntimeError(
                "a scheduled micro-batch's loss ran the Megatron strategy's logits on other rows than the "
                "micro-batch's input_ids: under pipeline stages the loss must run it once, on those rows"
            )
        return self.logits[:, :width]


def _to_last_stage(batches: list[Any], pipe: Pipeline) -> list[list[Any]] | None:
    """Every pipeline group member's ``batches``, by stage, on the last stage (None elsewhere)."""
    gathered: list[Any] | None = [None] * len(pipe.ranks) if pipe.last else None
    dist.gather_object(batches, gathered, dst=pipe.ranks[-1], group=pipe.group)
    return gathered


def _from_last_stage(results: list[list[Any]] | None, pipe: Pipeline) -> list[Any]:
    """This rank's results from the last stage (given there, by stage); the others' go as host tensors."""
    sent = None
    if results is not None:  # the last stage: its own kept where computed
        sent = [None if stage == pipe.stage else _on_host(r) for stage, r in enumerate(results)]
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, sent, src=pipe.ranks[-1], group=pipe.group)
    return results[pipe.stage] if results is not None else mine[0]


def _on_host(x: Any) -> Any:
    """``x`` with every tensor in it (nested in tuples, lists and dicts) detached and on the host."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_on_host(v) for v in x)
    if isinstance(x, dict):
        return {k: _on_host(v) for k, v in x.items()}
    return x
