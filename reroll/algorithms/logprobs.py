"""Per-token log-probs and entropy read off a causal LM's logits, in the one alignment the losses use.

Column ``t`` belongs to token ``t`` and is read off the model's output at position ``t - 1``, the
last position that has not seen token ``t``; column 0 is 0 (``reroll.data.types``). The critic's
values follow the same alignment (``reroll.algorithms.value.token_values``).

Memory: a ``(tokens, vocab)`` fp32 copy of the logits is never made. With Qwen's 152k vocabulary a
batch of 256 x 384 tokens would need 60 GB in fp32 (and autograd would keep several such tensors for
backward). Instead the logits (any dtype, as the model returns them) are read ``chunk_tokens`` rows at a
time, upcast to fp32 only inside a chunk, and reduced to per-token numbers at once. A chunked loop under
plain autograd would still keep every chunk's fp32 intermediates until backward, so the work is a
custom ``autograd.Function``: forward keeps only the logits (which autograd holds anyway, being the
model's output) and the entropy when it was computed; backward recomputes each chunk's softmax and
writes that chunk of the gradient, ``(onehot - p) / temperature`` for the log-prob and
``-p (log p + H) / temperature`` for the entropy, in the logits' dtype. Peak extra memory, forward and
backward alike, is a few fp32 chunks (about ``chunk_tokens x vocab x 4`` bytes each) plus the gradient
of the logits that backward must return.

Passes over a chunk: torch's ``log_softmax`` and ``softmax`` with ``dtype=float32`` read the chunk in
its own dtype and upcast as they go, so at temperature 1 the log-probs cost one read of the chunk and one
fp32 write (an upcast copy followed by ``logsumexp`` made five passes), and their backward one softmax,
one scaling and the cast into the gradient. On an H200 these chunks' elementwise kernels were about a
third of the training pass (``logging.profile_steps``). On CPU (``benchmarks/logprob_memory.py
--temperature 1.0``, 8 x 512 x 32000 logits, log-probs and entropy) fp32 forward 0.69 -> 0.41 s and
forward + backward 1.32 -> 1.05 s; bf16 forward 0.73 -> 0.65 s, forward + backward 1.33 -> 1.39 s
(the CPU's bf16-to-fp32 softmax is the slower kernel there).

The trainer does not even make the logits where it can: ``linear_logprobs_and_entropy`` takes the head's
input (the hidden states of the scored positions) and its weight, makes the logits a chunk at a time
and keeps none for backward, which makes them again (``reroll.roles.scored_tokens.fused_head_at``
says which models take it). On CPU (``benchmarks/head_memory.py``, a 0.5B head, 4096 tokens, bf16) the
forward + backward's peak above its inputs went 2.49 -> 0.54 GiB, for 1.3x the seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

# Rows per chunk: about 2**24 fp32 elements (64 MiB) per intermediate, 110 tokens at a 152k vocabulary;
# on a GPU 2**26 (256 MiB, 441 tokens): fewer, larger kernels. Measured on an H200 (0.5B shape, 256 x 384
# tokens, 64 rows a pass, `benchmarks/train_passes.py`): train 1.44 -> 1.38 s, reference 0.49 -> 0.46 s.
CHUNK_ELEMENTS = 2**24
CHUNK_ELEMENTS_CUDA = 2**26
# The fused head (``linear_logprobs_and_entropy``) on a GPU: 2**28 elements a chunk (about 1,766 tokens
# at 152k). Its backward makes each block's logits again, and larger blocks pay: on an H100 80GB
# (2026-12-07, 0.5B shape, 256 x 384 tokens, 64 rows a pass, `benchmarks/train_passes.py`) the training
# pass took 1.52 s at 2**26 and 1.27 s at 2**28 (1.06 s with the logits kept), its peak 32.8 and 35.0 GiB
# (41.5 GiB kept).
LINEAR_CHUNK_ELEMENTS_CUDA = 2**28


def chunk_rows(logits: Tensor) -> int:
    """Rows of ``(N, V)`` logits to upcast at a time on their device."""
    return _rows_of(logits.shape[-1], logits.is_cuda)


def _rows_of(vocab: int, cuda: bool, cuda_elements: int = CHUNK_ELEMENTS_CUDA) -> int:
    return max(1, (cuda_elements if cuda else CHUNK_ELEMENTS) // vocab)


def token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """log p(x_t | x_<t) for every position: ``(B, T, V)`` logits, ``(B, T)`` ids -> ``(B, T)`` fp32;
    column 0 is 0.

    Logits are divided by ``temperature`` first (as the engine samples), so the ratio the policy loss
    sees is the one of the sampling distribution. ``chunk_tokens``: rows upcast at a time (default:
    ``chunk_rows``: about 2**24 fp32 elements, 2**26 on a GPU). ``mask`` ``(B, T)``: score only the
    columns it marks (a batch's response tokens); the others are 0 and cost nothing past the model's
    forward (the vocabulary-wide work of prompt and padding positions is skipped).
    """
    logp, _ = _next_token_stats(logits, input_ids, temperature, chunk_tokens, entropy=False, mask=mask)
    return logp


def token_entropy(logits: Tensor, temperature: float = 1.0, *, chunk_tokens: int | None = None) -> Tensor:
    """Entropy of the next-token distribution, aligned like ``token_logprobs``: ``(B, T, V)`` -> ``(B, T)``."""
    _, ent = _next_token_stats(logits, None, temperature, chunk_tokens, entropy=True)
    return ent


def token_logprobs_and_entropy(
    logits: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(token_logprobs, token_entropy)`` in one pass over the logits, both ``(B, T)`` fp32; ``mask``:
    only the columns it marks, as for ``token_logprobs``.

    Backward through the entropy is computed only when its gradient is used: detach it (or leave it out
    of the loss) and backward costs the same as for the log-probs alone."""
    return _next_token_stats(logits, input_ids, temperature, chunk_tokens, entropy=True, mask=mask)


def selected_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(K, V)`` logits already taken at the positions that score ``targets`` ``(K,)`` (the head run
    on those positions alone) -> log p(target) and the entropy (zeros unless ``entropy``), ``(K,)``
    fp32 each; chunked with a recomputing backward like ``token_logprobs``. No alignment: row ``k``
    scores ``targets[k]``."""
    scale = temperature if temperature > 0 else 1.0
    rows = chunk_tokens or chunk_rows(logits)
    return _ChunkedNextToken.apply(logits, targets.to(logits.device), scale, entropy, rows, None)


def linear_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``selected_logprobs_and_entropy(F.linear(hidden, weight, bias), targets, ...)`` without the ``(K, V)``
    logits: ``(K, H)`` hidden states, a ``(V, H)`` head (``bias`` ``(V,)`` or None), ``(K,)`` targets ->
    log p(target) and the entropy (zeros unless ``entropy``), ``(K,)`` fp32 each.

    Forward makes the logits ``chunk_tokens`` rows at a time (default: ``chunk_rows``'s count, on a GPU
    ``LINEAR_CHUNK_ELEMENTS_CUDA``'s) in the head's dtype, as ``F.linear`` makes them, and reduces each
    chunk as ``selected_logprobs_and_entropy`` does (the same function), keeping each row's log-sum-exp
    too. Autograd keeps ``hidden`` and ``weight`` (which it holds anyway: the head's input and
    parameter), the entropy and the log-sum-exp (``K`` floats each). Backward goes over blocks of the vocabulary with all ``K`` rows (as many elements a
    block as a chunk): it makes the block's logits again, their softmax from the log-sum-exp and their
    gradient by the logits path's formulas (``(onehot - p) / T``, ``-p (log p + H) / T``: the same
    function), cast to the head's dtype as the logits' gradient is; then writes the block's rows of the
    weight's gradient, ``g^T @ hidden`` (one product over all ``K`` rows, in the weight's dtype), and adds
    ``g @ W[block]`` into an fp32 ``(K, H)`` sum for the hidden states' gradient. Extra memory, forward
    and backward: a few fp32 blocks and that ``(K, H)`` sum, against ``K x V`` logits and their gradient
    in the logits path. Blocks of the vocabulary rather than chunks of rows in backward: each chunk
    would add a ``(V, H)`` product into an fp32 sum of the weight's gradient (``4 V H`` bytes, 2.2 GB
    for a 7B model's head, read and written once a chunk). Gradients only for the inputs that need them
    (a frozen head: none for the weight); the entropy's backward only when its gradient is used."""
    scale = temperature if temperature > 0 else 1.0
    rows = chunk_tokens or _rows_of(weight.shape[0], weight.is_cuda, LINEAR_CHUNK_ELEMENTS_CUDA)
    return _LinearNextToken.apply(hidden, weight, bias, targets.to(hidden.device), scale, entropy, rows)


def _next_token_stats(
    logits: Tensor,
    input_ids: Tensor | None,
    temperature: float,
    chunk_tokens: int | None,
    *,
    entropy: bool,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Shifted, padded ``(B, T)`` log-probs (zeros without ``input_ids``) and entropy (zeros unless
    ``entropy``). Without ``mask`` every position is scored, the last one of a row too (it has no next
    token; 1/T extra work), so that the logits are read as the contiguous ``(B*T, V)`` view without a
    copy; with it, the positions before the marked columns, gathered a chunk at a time."""
    b, t, v = logits.shape
    scale = temperature if temperature > 0 else 1.0
    rows = chunk_tokens or chunk_rows(logits)
    flat = logits.reshape(b * t, v)
    targets = None
    if input_ids is not None:  # the next token of each position; the last position's is a dummy 0
        targets = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=0).reshape(b * t).to(logits.device)
    scored = None
    if mask is not None:  # position t-1 scores column t
        before = torch.nn.functional.pad(mask[:, 1:].bool(), (0, 1), value=False).reshape(b * t)
        scored = before.to(logits.device).nonzero().squeeze(-1)
    logp, ent = _ChunkedNextToken.apply(flat, targets, scale, entropy, rows, scored)

    def align(x: Tensor) -> Tensor:  # position t-1 scores token t; column 0 is 0
        return torch.nn.functional.pad(x.view(b, t)[:, :-1], (1, 0), value=0.0)

    return align(logp), align(ent)


def _chunks(n: int, rows: int, scored: Tensor | None) -> list[slice | Tensor]:
    """The row selections of a chunked pass: slices of all ``n`` rows, or pieces of ``scored``'s indices."""
    if scored is None:
        return [slice(a, a + rows) for a in range(0, n, rows)]
    return list(scored.split(rows))


class _ChunkedNextToken(torch.autograd.Function):
    """``(N, V)`` logits -> per-row fp32 log p(target) and entropy, chunk by chunk (see the module doc);
    with ``scored`` (row indices) only those rows, the others 0 with no gradient.

    Each chunk is one fp32 copy of its logits worked on in place, plus one more buffer where the
    entropy needs p and log p at once."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        targets: Tensor | None,
        scale: float,
        entropy: bool,
        rows: int,
        scored: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        n = logits.shape[0]
        logp = torch.zeros(n, dtype=torch.float32, device=logits.device)
        ent = torch.zeros(n, dtype=torch.float32, device=logits.device)
        for s in _chunks(n, rows, scored):
            _chunk_stats(logits[s], targets, scale, entropy, logp, ent, s)
        ctx.save_for_backward(logits, targets, ent, scored)
        ctx.scale, ctx.rows = scale, rows
        ctx.set_materialize_grads(False)
        if targets is None:
            ctx.mark_non_differentiable(logp)
        if not entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp: Tensor | None, grad_ent: Tensor | None):
        logits, targets, ent, scored = ctx.saved_tensors
        if targets is None:
            grad_logp = None
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None, None
        grad = torch.empty_like(logits) if scored is None else torch.zeros_like(logits)
        for s in _chunks(logits.shape[0], ctx.rows, scored):
            g = _chunk_grad(logits[s], targets, ent, grad_logp, grad_ent, ctx.scale, s)
            grad[s] = g if isinstance(s, slice) else g.to(grad.dtype)  # index_put wants the dtype
        return grad, None, None, None, None, None


class _LinearNextToken(torch.autograd.Function):
    """``(K, H)`` hidden states and a linear head -> per-row fp32 log p(target) and entropy
    (``linear_logprobs_and_entropy``): forward by chunks of rows, backward by blocks of the vocabulary."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        scale: float,
        entropy: bool,
        rows: int,
    ) -> tuple[Tensor, Tensor]:
        k = hidden.shape[0]
        logp = torch.zeros(k, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(k, dtype=torch.float32, device=hidden.device)
        lse = torch.zeros(k, dtype=torch.float32, device=hidden.device)
        for s in _chunks(k, rows, None):
            _chunk_stats(F.linear(hidden[s], weight, bias), targets, scale, entropy, logp, ent, s, lse)
        ctx.save_for_backward(hidden, weight, bias, targets, ent, lse)
        ctx.scale, ctx.cols = scale, max(1, rows * weight.shape[0] // max(k, 1))  # as many elements a block
        ctx.set_materialize_grads(False)
        if not entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp: Tensor | None, grad_ent: Tensor | None):
        """By blocks of ``cols`` vocabulary entries, all ``K`` rows at a time: each block's logits again
        (``h W[block]^T``), their softmax from the forward's log-sum-exp, their gradient ``g``; then
        ``grad_W[block] = g^T h`` (one product over all rows, written once in the weight's dtype) and
        ``grad_h += g W[block]`` (summed over the blocks in fp32, ``K x H``)."""
        hidden, weight, bias, targets, ent, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None, None, None
        sum_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        for a in range(0, weight.shape[0], ctx.cols):
            vb = slice(a, a + ctx.cols)
            x = F.linear(hidden, weight[vb], None if bias is None else bias[vb])
            logq = x.to(torch.float32, copy=True).div_(ctx.scale).sub_(lse[:, None])  # log q in the block
            p = logq.exp() if grad_ent is not None else logq.exp_()
            g = _grad_of(p, logq, ent, grad_logp, grad_ent)
            if grad_logp is not None:  # + onehot(y) g_y, for the targets in this block
                _add_at_targets(g, targets - a, grad_logp)
            g = g if ctx.scale == 1.0 else g.div_(ctx.scale)
            if grad_b is not None:
                grad_b[vb] = g.sum(0)
            g = g.to(weight.dtype)  # the logits' gradient, in their dtype (a no-op in fp32)
            if grad_w is not None:
                torch.mm(g.T, hidden, out=grad_w[vb])
            if sum_h is not None:
                _add_product(sum_h, g, weight[vb])
        grad_h = None if sum_h is None else sum_h.to(hidden.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def _add_at_targets(g: Tensor, col: Tensor, grad_logp: Tensor) -> None:
    """``g[k, col[k]] += grad_logp[k]`` for the rows ``k`` whose ``col`` falls inside ``g``'s ``(K, n)``
    block; the other rows get ``+ 0.0`` at a column clamped into it, which leaves every value equal
    (``x + 0.0 == x``; a -0.0 becomes 0.0). One element a row, so no two adds meet. Selecting the rows instead (``nonzero``)
    made the host wait for the GPU at every block of the vocabulary."""
    inside = (col >= 0) & (col < g.shape[1])
    add = torch.where(inside, grad_logp, 0.0)
    g.scatter_add_(1, col.clamp(0, g.shape[1] - 1)[:, None], add[:, None])


def _add_product(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` into fp32 ``out``: in place for fp32 factors, else their product (in their dtype,
    accumulated in fp32 inside the kernel) rounded once and added."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out += a @ b


def _chunk_stats(
    chunk: Tensor,
    targets: Tensor | None,
    scale: float,
    entropy: bool,
    logp: Tensor,
    ent: Tensor,
    s: slice | Tensor,
    lse: Tensor | None = None,
) -> None:
    """Writes rows ``s`` of ``logp`` (where ``targets``, per row), ``ent`` (where ``entropy``) and ``lse``
    (the log-sum-exp of the scaled logits, where given) from those rows' logits ``chunk`` ``(rows, V)``:
    one fp32 log-softmax, read at the targets and reduced to the entropy."""
    logq = _log_softmax(chunk, scale)
    if targets is not None:
        logp[s] = logq.gather(-1, targets[s, None]).squeeze(-1)
    if entropy:
        ent[s] = -logq.exp().mul_(logq).sum(-1)
    if lse is not None:  # log q_y = x_y / T - lse
        lse[s] = chunk.gather(-1, targets[s, None]).squeeze(-1).to(torch.float32).div_(scale) - logp[s]


def _chunk_grad(
    chunk: Tensor,
    targets: Tensor | None,
    ent: Tensor,
    grad_logp: Tensor | None,
    grad_ent: Tensor | None,
    scale: float,
    s: slice | Tensor,
) -> Tensor:
    """The fp32 gradient of rows ``s``'s logits ``chunk`` ``(rows, V)``, recomputed from them: ``targets``,
    ``ent`` and the incoming gradients are per row (at least one gradient not None)."""
    logq = _log_softmax(chunk, scale) if grad_ent is not None else None
    p = _softmax(chunk, scale) if logq is None else logq.exp()
    g = _grad_of(p, logq, ent[s], _rows(grad_logp, s), _rows(grad_ent, s))
    if grad_logp is not None:
        g.scatter_add_(-1, targets[s, None], grad_logp[s, None])
    return g if scale == 1.0 else g.div_(scale)


def _rows(x: Tensor | None, s: slice | Tensor) -> Tensor | None:
    return None if x is None else x[s]


def _grad_of(
    p: Tensor, logq: Tensor | None, ent: Tensor, grad_logp: Tensor | None, grad_ent: Tensor | None
) -> Tensor:
    """Of logits whose (fp32) softmax is ``p`` (and log-softmax ``logq``, needed where ``grad_ent``): the
    gradient times ``T``, but the ``onehot(y) g_y`` term, which the caller adds (it knows where the
    targets are). Works in ``p`` and ``logq``; ``ent`` and the gradients are per row."""
    if grad_ent is None:  # d log p_y / dx = onehot(y) - p
        return p.mul_(-grad_logp[:, None])
    # dH/dx = -p (log p + H); with the log-prob's: -p ((log p + H) g_H + g_y) + onehot(y) g_y
    g = logq.add_(ent[:, None]).mul_(grad_ent[:, None])
    if grad_logp is not None:
        g.add_(grad_logp[:, None])
    return g.mul_(p).neg_()


def _log_softmax(chunk: Tensor, scale: float) -> Tensor:
    """fp32 ``log_softmax(chunk / scale)``: at ``scale`` 1 one kernel that upcasts as it reads (the
    chunk is read once, the fp32 result written once), else an fp32 copy divided first (a copy even
    when the chunk is fp32: the logits are never written to)."""
    if scale == 1.0:
        return torch.log_softmax(chunk, dim=-1, dtype=torch.float32)
    return torch.log_softmax(chunk.to(torch.float32, copy=True).div_(scale), dim=-1)


def _softmax(chunk: Tensor, scale: float) -> Tensor:
    """fp32 ``softmax(chunk / scale)``, as ``_log_softmax``."""
    if scale == 1.0:
        return torch.softmax(chunk, dim=-1, dtype=torch.float32)
    return torch.softmax(chunk.to(torch.float32, copy=True).div_(scale), dim=-1)


def token_logprobs_at(logits: Tensor, ids: Tensor, *, chunk_tokens: int | None = None) -> Tensor:
    """log p(v | x_<t) for K token ids per position, aligned like ``token_logprobs``: ``(B, T, V)``
    logits, ``(B, T, K)`` ids -> ``(B, T, K)`` fp32; column 0 is 0. ``ids[b, t]`` are ids for column
    ``t`` (scored off position ``t - 1``). Chunked with a recomputing backward, like the log-probs."""
    b, t, v = logits.shape
    k = ids.shape[-1]
    rows = chunk_tokens or chunk_rows(logits)
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 0, 0, 1), value=0).reshape(b * t, k)
    out = _ChunkedGather.apply(logits.reshape(b * t, v), targets.to(logits.device), rows)
    return torch.nn.functional.pad(out.view(b, t, k)[:, :-1], (0, 0, 1, 0), value=0.0)


def token_log_softmax(logits: Tensor) -> Tensor:
    """The full next-token log-softmax, aligned like ``token_logprobs``: ``(B, T, V)`` -> ``(B, T, V)``
    fp32; column 0 is 0. Not chunked: it holds (B, T, V) fp32 (losses that need every token's mass)."""
    out = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.nn.functional.pad(out, (0, 0, 1, 0), value=0.0)


@torch.no_grad()
def token_topk(logits: Tensor, k: int, *, chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely next tokens at each position, aligned like ``token_logprobs``: ``(B, T, V)``
    -> (log-probs ``(B, T, k)`` fp32, ids ``(B, T, k)`` long), largest first; column 0 is 0 (ids 0).
    ``k`` past the vocabulary size gives the whole vocabulary."""
    b, t, v = logits.shape
    k = min(k, v)
    rows = chunk_tokens or chunk_rows(logits)
    flat = logits.reshape(b * t, v)
    values = torch.empty(b * t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(b * t, k, dtype=torch.long, device=logits.device)
    for a in range(0, b * t, rows):
        s = slice(a, a + rows)
        top = _log_softmax(flat[s], 1.0).topk(k, dim=-1)
        values[s], ids[s] = top.values, top.indices

    def align(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x.view(b, t, k)[:, :-1], (0, 0, 1, 0), value=0)

    return align(values), align(ids)


class _ChunkedGather(torch.autograd.Function):
    """``(N, V)`` logits, ``(N, K)`` ids -> ``(N, K)`` fp32 log-softmax at those ids, chunk by chunk;
    backward ``d/dx = scatter(g) - p * sum_k g_k``, recomputed per chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, rows: int) -> Tensor:
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        for a in range(0, logits.shape[0], rows):
            s = slice(a, a + rows)
            out[s] = _log_softmax(logits[s], 1.0).gather(-1, targets[s])
        ctx.save_for_backward(logits, targets)
        ctx.rows = rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, targets = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.rows):
            s = slice(a, a + ctx.rows)
            g = _softmax(logits[s], 1.0).mul_(-grad_out[s].sum(-1, keepdim=True))
            g.scatter_add_(-1, targets[s], grad_out[s])
            grad[s] = g
        return grad, None, None
