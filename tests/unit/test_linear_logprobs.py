"""``linear_logprobs_and_entropy`` (log-probs and entropy from the hidden states and the head's weight, no
``(K, V)`` logits kept) equals the logits path ``selected_logprobs_and_entropy(F.linear(...))``: values
and the gradients of the hidden states, weight and bias; and the trainer's head takes it where it may
(``fused_head_at``), with the same numbers.

Tolerance (``_bounds``), from the arithmetic of the two paths, for inputs of unit roundoff ``u`` (2**-24
float32, 2**-8 bfloat16). Both make the logits ``x = h W^T + b`` in the inputs' dtype, the fused one by
chunks of rows (forward) and blocks of the vocabulary (backward); a matmul's blocking may depend on its
shape, so the paths' logits may differ: by ``dx``, which the test measures (the same calls the paths
make), ``dz = dx / T`` once scaled. From there every step is float32 (or a cast to ``u``) (first order,
with a margin ``1 + expm1(2 max dz)`` for the second):

- ``log q = z - lse(z)`` moves by at most ``dz + s`` with ``s = sum_j p_j dz_j`` (the log-sum-exp's
  derivative is ``p``), in the fused backward plus the float32 rounding of its ``lse`` (recovered from
  the forward as ``z_y - log q_y``); the entropy ``H``, whose derivative is ``-p (log p + H)``, by at
  most ``sum_j p_j |log p_j + H| dz_j``; each plus a float32 reduction over ``V`` (``2 V 2**-24``);
- the logits' gradient ``G = (g_y (onehot - p) - g_H p (log p + H)) / T`` by ``A`` (``p`` moving by ``p``
  times log q's move, ``log p + H`` by log q's plus H's), plus ``u (|G| + A)`` per path where it is
  rounded to the dtype;
- the weight's gradient ``G^T h``, the hidden states' ``G W`` and the bias's ``sum_k G`` by those
  differences through the same products, plus float32 summation order (``n 2**-24`` of the terms'
  magnitudes for ``n`` terms, twice) and the dtype's rounding of the results (and, in the fused hidden
  states' gradient, of each vocabulary block's product): ``3 u`` of the terms' magnitudes.

Magnitudes (``p``, ``|G|``, ``|h|``, ``|W|``) come from a float32 reference on the same inputs. The
bounds come out near 1e-5 of the values in float32 and 4e-2 in bfloat16 (the gradients' ``3 u`` of sums
of absolute terms); the test checks that they stay well below the values, so that a wrong formula
(a sign, a missing ``1 / T``) cannot pass.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from reroll.algorithms import logprobs
from reroll.algorithms.logprobs import linear_logprobs_and_entropy, selected_logprobs_and_entropy

F32_U = 2.0**-24  # float32's unit roundoff: the accumulation of every matmul and reduction here
K, H, V = 37, 16, 50


def _inputs(dtype, *, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(K, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    y = torch.randint(0, V, (K,), generator=g)
    g_lp, g_ent = torch.randn(K, generator=g), torch.randn(K, generator=g)
    return h, w, b, y, g_lp, g_ent


def _run(fused: bool, h, w, b, y, t, g_lp, g_ent, chunk):
    """Values and gradients of ``sum(g_lp * logp) + sum(g_ent * ent)`` (``g_*`` None: not in the loss)."""
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    if fused:
        lp, ent = linear_logprobs_and_entropy(hh, ww, bb, y, t, chunk_tokens=chunk)
    else:
        lp, ent = selected_logprobs_and_entropy(F.linear(hh, ww, bb), y, t, chunk_tokens=chunk)
    loss = sum((g * v).sum() for g, v in ((g_lp, lp), (g_ent, ent)) if g is not None)
    loss.backward()
    return {"logp": lp, "ent": ent, "h": hh.grad, "w": ww.grad, "b": None if bb is None else bb.grad}


def _bounds(h, w, b, y, t, g_lp, g_ent, u: float, chunk: int | None) -> dict[str, torch.Tensor]:
    """How far the two paths may differ, elementwise (module docstring)."""
    rows = chunk or logprobs._rows_of(V, h.is_cuda)
    cols = max(1, rows * V // K)  # the backward's blocks of the vocabulary (as many elements)
    full = F.linear(h, w, b)
    chunked = torch.cat([F.linear(h[a : a + rows], w, b) for a in range(0, K, rows)])
    blocks = [F.linear(h, w[a : a + cols], None if b is None else b[a : a + cols]) for a in range(0, V, cols)]
    dx = torch.maximum((chunked - full).abs(), (torch.cat(blocks, 1) - full).abs())
    dz = dx.float() / t  # (K, V): the scaled logits' difference, forward's or backward's
    h, w = h.float(), w.float()
    b = None if b is None else b.float()
    x = F.linear(h, w, b)
    margin = 1 + torch.expm1(2 * dz.amax(-1, keepdim=True))  # the second order, at most this share
    logq = torch.log_softmax(x / t, -1)
    p = logq.exp()
    ent = -(p * logq).sum(-1, keepdim=True)
    s = (p * dz).sum(-1, keepdim=True)  # the log-sum-exp's move
    # the backward's log q = z - lse, lse = z_y - log q_y from the forward: its float32 rounding
    z_max = (x / t).abs().amax(-1, keepdim=True)
    lse = torch.logsumexp(x / t, -1, keepdim=True)
    d_lse = F32_U * (V + 4 * z_max + 2 * lse.abs())
    d_logq = margin * (dz + s + d_lse)
    d_ent = margin * (p * (logq + ent).abs() * dz).sum(-1, keepdim=True)
    zero = torch.zeros(K, device=h.device)
    gl = (g_lp if g_lp is not None else zero).abs()[:, None]
    ge = (g_ent if g_ent is not None else zero).abs()[:, None]
    onehot = F.one_hot(y, V).float()
    big_g = (gl * (onehot + p) + ge * p * (logq + ent).abs()) / t  # >= |G|, elementwise
    # G = (g_y (onehot - p) - g_H p (log p + H)) / T: p moves by p d_logq, (log p + H) by d_logq + d_ent
    a = p * (gl * d_logq + ge * (d_logq * ((logq + ent).abs() + margin) + margin * d_ent)) / t
    e = a + 2 * u * (big_g + a)
    onehot_dz = (onehot * dz).sum(-1)
    out = {
        "logp": margin.squeeze(-1) * (onehot_dz + s.squeeze(-1)) + 2 * V * F32_U,
        "ent": d_ent.squeeze(-1) + 2 * V * F32_U * (1 + ent.squeeze(-1)),
        "h": e @ w.abs() + (2 * V * F32_U + 3 * u) * (big_g @ w.abs()),
        "w": e.T @ h.abs() + (2 * K * F32_U + 3 * u) * (big_g.T @ h.abs()),
    }
    if b is not None:
        out["b"] = e.sum(0) + (2 * K * F32_U + 3 * u) * big_g.sum(0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("use", ["logp", "logp+entropy", "entropy"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_fused_equals_the_logits_path(dtype, bias, temperature, use, chunk):
    h, w, b, y, g_lp, g_ent = _inputs(dtype, bias=bias)
    g_lp = g_lp if "logp" in use else None
    g_ent = g_ent if "entropy" in use else None
    fused = _run(True, h, w, b, y, temperature, g_lp, g_ent, chunk)
    ref = _run(False, h, w, b, y, temperature, g_lp, g_ent, chunk)
    u = torch.finfo(dtype).eps / 2
    bounds = _bounds(h, w, b, y, temperature, g_lp, g_ent, u, chunk)
    for name, bound in bounds.items():
        got, want = fused[name].detach(), ref[name].detach()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert (want != 0).any(), name  # the gradient reached this input
        diff = (got.float() - want.float()).abs()
        assert (diff <= bound).all(), f"{name}: {float((diff - bound).max()):.3g} past the bound"
        # the bound says something: a wrong formula (a sign, a missing 1/T) is off by O(1) of the values
        assert float(bound.max()) <= (1e-3 if dtype == torch.float32 else 0.15) * float(want.abs().max()), (
            name
        )


def test_a_frozen_head_gets_no_weight_gradient_and_the_same_hidden_one():
    h, w, b, y, g_lp, _ = _inputs(torch.float32, bias=True)
    hh = h.clone().requires_grad_()
    lp, _ = linear_logprobs_and_entropy(hh, w, b, y, 0.7, entropy=False, chunk_tokens=5)
    (g_lp * lp).sum().backward()
    ref = _run(False, h, w, b, y, 0.7, g_lp, None, 5)
    torch.testing.assert_close(hh.grad, ref["h"])  # float32, the same chunks: order-of-summation noise
    assert w.grad is None and b.grad is None


def test_the_entropy_backward_runs_only_where_its_gradient_is_used(monkeypatch):
    """Detached (a metric), the entropy costs backward nothing: its gradient comes in as None, and each
    vocabulary block's gradient is the log-prob's alone (no log q kept beside p)."""
    h, w, b, y, g_lp, g_ent = _inputs(torch.float32, bias=False)
    seen: list[bool] = []
    inner = logprobs._grad_of
    monkeypatch.setattr(
        logprobs, "_grad_of", lambda p, lq, e, gl, ge: seen.append(ge is not None) or inner(p, lq, e, gl, ge)
    )
    for used in (False, True):
        hh = h.clone().requires_grad_()
        lp, ent = linear_logprobs_and_entropy(hh, w, b, y, entropy=True, chunk_tokens=10)
        assert ent.requires_grad
        loss = (g_lp * lp).sum() + (g_ent * (ent if used else ent.detach())).sum()
        seen.clear()
        loss.backward()
        assert seen == [used] * 4, (used, seen)  # 10 rows x 50 = 500 elements a block: 13 columns, 4 blocks
    _, ent = linear_logprobs_and_entropy(h.requires_grad_(), w, b, y, entropy=False)
    assert not ent.requires_grad and (ent == 0).all()


def _tiny_lm(*, tie: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg)


def _scored(model, call=None, *, fused: bool):
    """Log-probs and entropy of a few response columns through ``scored_token_stats``, their loss's
    gradients, and the shapes the head returned."""
    from reroll.roles.scored_tokens import scored_token_stats

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 2:5], mask[2, 1:] = True, True
    rows, cols = F.pad(mask[:, 1:], (0, 1), value=False).nonzero(as_tuple=True)
    model.zero_grad(set_to_none=True)
    shapes: list[tuple[int, ...]] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, _i, o: shapes.append(tuple(o.shape))
    )
    call = call or (lambda: model(input_ids=ids).logits)
    lp, ent = scored_token_stats(
        model, call, rows * 7 + cols, rows, cols, ids, 0.7, entropy=True, fused=fused
    )
    hook.remove()
    (lp.sum() - 0.3 * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return lp.detach(), ent.detach(), grads, shapes


@pytest.mark.parametrize("tie", [True, False])
def test_the_fused_head_gives_the_logits_paths_values_and_gradients(tie):
    """The trainer's fused head (``fused_head_at``) against ``head_at``'s logits in a tiny model, tied
    embedding or not. They differ in the head's summation order alone (its matmuls in chunks), float32
    noise of ~1e-7 relative that assert_close's float32 defaults (rtol 1.3e-6, atol 1e-5) hold."""
    from reroll.roles.scored_tokens import fused_head_problem

    model = _tiny_lm(tie=tie)
    assert fused_head_problem(model) is None
    lp, ent, grads, shapes = _scored(model, fused=True)
    assert shapes == [(1, 9)]  # one log-prob per scored token came out of the head, no logits
    assert "forward" not in vars(model.lm_head)  # the head's own forward is back
    lp_ref, ent_ref, grads_ref, shapes_ref = _scored(model, fused=False)
    assert shapes_ref == [(1, 9, 50)]
    torch.testing.assert_close(lp, lp_ref)
    torch.testing.assert_close(ent, ent_ref)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], msg=name)


def test_a_model_that_changes_its_heads_output_keeps_the_logits_path(caplog):
    """A forward that rescales what its head returns (as a logit soft-cap does) would rescale the fused
    log-probs too: the first call sees it, runs again on the logits, warns, and the model keeps them."""
    from reroll.roles.scored_tokens import fused_head_problem

    class Capped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _tiny_lm(tie=True)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.inner.lm_head

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.inner(input_ids=input_ids).logits / 5) * 5

    model = Capped()
    with caplog.at_level(logging.WARNING):
        lp, ent, grads, shapes = _scored(model, lambda: model(_ids()), fused=True)
    assert shapes == [(1, 9), (1, 9, 50)]  # tried, then the logits
    assert "changes what its lm_head returns" in caplog.text
    assert "changes what its lm_head returns" in fused_head_problem(model)
    lp_ref, ent_ref, grads_ref, _ = _scored(model, lambda: model(_ids()), fused=False)
    assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref)  # the same path, the same kernels
    for name, grad in grads.items():
        assert torch.equal(grad, grads_ref[name]), name


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))


def test_heads_the_fused_path_leaves_alone():
    """A compiled model, a LoRA-wrapped head, a head whose forward another library replaced: no fused head."""
    from peft import LoraConfig, get_peft_model

    from reroll.roles.scored_tokens import fused_head_at, fused_head_problem

    model = _tiny_lm(tie=False)
    model.lm_head.forward = model.lm_head.forward  # as accelerate's hooks set it
    assert "replaced" in fused_head_problem(model)
    del model.lm_head.forward
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head"]))
    assert "not a plain torch.nn.Linear" in fused_head_problem(wrapped)
    with fused_head_at(wrapped, torch.tensor([0]), torch.tensor([1]), 1.0, entropy=False) as head:
        assert head is None
    compiled = _tiny_lm(tie=True)
    compiled.compile()
    assert "compiled" in fused_head_problem(compiled)
    assert "not one" in fused_head_problem(compiled.model)  # the base model: no lm_head


def test_adding_at_the_targets_of_a_block_equals_selecting_its_rows():
    """The fused backward's ``+ onehot(y) g_y`` for a block of the vocabulary, without selecting the rows
    whose target falls in it (a ``nonzero``: on a GPU the host waited at every block), equals the
    selection's ``index_put_`` exactly: the rows inside get the same one addition, the others ``+ 0.0``.
    Targets below, inside and above the block; a NaN gradient of a row outside stays out."""
    g = torch.Generator().manual_seed(0)
    block = torch.randn(6, 5, generator=g)
    col = torch.tensor([-3, 0, 2, 4, 5, 9])  # targets minus the block's start: rows 1, 2, 3 inside
    grad = torch.randn(6, generator=g)
    grad[5] = float("nan")
    want = block.clone()
    row = ((col >= 0) & (col < 5)).nonzero().squeeze(-1)
    want.index_put_((row, col[row]), grad[row], accumulate=True)
    got = block.clone()
    logprobs._add_at_targets(got, col, grad)
    assert torch.equal(got, want)
    assert not torch.equal(got, block)  # something was added
