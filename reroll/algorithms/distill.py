"""Distillation losses, per token: ``(loss (B, T), metrics)``, aggregation left to ``aggregate``.

Two settings (docs/algorithms.md has the formulas and papers):

- on-policy: the student samples, the teacher scores the sampled tokens. ``reverse_kl_pg_loss`` is
  the per-token reverse KL KL(pi_S || pi_T) estimated on the student's own tokens and minimised as a
  policy gradient whose per-token advantage is ``log pi_T(y_t) - log pi_S(y_t)`` (on-policy
  distillation, Lu & Thinking Machines 2025; GKD with lambda = 1 and the reverse KL, Agarwal et al.,
  arXiv 2306.13649).
- offline: the teacher's top-k next-token log-probs over fixed (SFT) rows, cached once.
  ``forward_kl_topk_loss`` is KL(pi_T || pi_S) over the teacher's top-k tokens (the teacher's
  distribution renormalised over them), optionally mixed with the cross-entropy on the row's own
  tokens (Hinton et al., arXiv 1503.02531; MiniLLM / top-k KD).

Shapes: ``logprobs``, ``teacher_logprobs`` (B, T) aligned like ``token_logprobs`` (column t scores
token t); ``student_topk`` / ``teacher_topk`` (B, T, K) the log-probs of the same K token ids at each
position; ``response_mask`` bool (B, T). Metrics are detached scalar tensors over the masked tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reroll.algorithms.aggregation import masked_mean

Metrics = dict[str, Tensor]


def reverse_kl_pg_loss(
    logprobs: Tensor, teacher_logprobs: Tensor, response_mask: Tensor
) -> tuple[Tensor, Metrics]:
    """l_t = -A_t log pi_S(y_t), A_t = sg(log pi_T(y_t) - log pi_S(y_t)): (B, T) -> (B, T).

    With y_t sampled from pi_S, E[log pi_S(y_t) - log pi_T(y_t)] is the per-token reverse KL, and the
    gradient of this loss is its REINFORCE estimate with no discounting across tokens (each token is
    credited with its own KL only), as in on-policy distillation (Thinking Machines, 2025) and GKD
    (arXiv 2306.13649). ``distill/reverse_kl`` is the mean sampled estimate over the masked tokens.
    """
    gap = (logprobs - teacher_logprobs).detach()  # log pi_S - log pi_T, the per-token KL sample
    loss = gap * logprobs
    metrics = {
        "distill/reverse_kl": masked_mean(gap, response_mask),
        "distill/teacher_logprob": masked_mean(teacher_logprobs.detach(), response_mask),
        "distill/student_logprob": masked_mean(logprobs.detach(), response_mask),
    }
    return loss * response_mask, metrics


def reverse_kl_topk_loss(
    student_logprobs: Tensor, teacher_topk: Tensor, teacher_ids: Tensor, response_mask: Tensor
) -> tuple[Tensor, Metrics]:
    """l_t = sum_v pi_S(v) (log pi_S(v) - log pi_T(v)), the exact per-token reverse KL at each prefix the
    student sampled: (B, T, V), (B, T, K), (B, T, K) -> (B, T).

    GKD on student outputs with the reverse KL (Agarwal et al., arXiv 2306.13649). The teacher is known on
    its top K tokens; its remaining mass 1 - sum_K pi_T is spread evenly over the other V - K tokens
    (exact when K = V). ``student_logprobs`` is the student's full next-token log-softmax, aligned like
    the log-probs (column t is the distribution of token t); memory: one (B, T, V) fp32 tensor.
    """
    vocab, k = student_logprobs.shape[-1], teacher_topk.shape[-1]
    top = teacher_topk.float()
    rest = (1.0 - top.exp().sum(-1, keepdim=True)).clamp(min=1e-12) / max(vocab - k, 1)
    teacher = (
        rest.log().expand(*top.shape[:-1], vocab).clone() if k < vocab else torch.zeros_like(student_logprobs)
    )
    teacher = teacher.scatter(-1, teacher_ids, top)
    kl = (student_logprobs.exp() * (student_logprobs - teacher)).sum(-1)
    metrics = {"distill/reverse_kl": masked_mean(kl.detach(), response_mask)}
    return kl * response_mask, metrics


def forward_kl_topk_loss(
    student_topk: Tensor,
    teacher_topk: Tensor,
    target_logprobs: Tensor,
    response_mask: Tensor,
    *,
    ce_weight: float = 0.0,
) -> tuple[Tensor, Metrics]:
    """l_t = (1 - w) sum_k q_k (log q_k - log pi_S(v_k)) - w log pi_S(y_t): (B, T, K) -> (B, T).

    q = softmax over the teacher's top-k log-probs (its distribution renormalised over the K ids v_k);
    ``student_topk`` are the student's log-probs of the same ids; ``target_logprobs`` (B, T) the
    student's log-probs of the row's own tokens y_t (the cross-entropy term, weight w = ``ce_weight``).
    Forward KL as in knowledge distillation (Hinton et al., arXiv 1503.02531) with the teacher truncated
    to its top k. ``distill/forward_kl`` and ``distill/ce`` are the two terms' token means.
    """
    teacher = torch.log_softmax(teacher_topk.float(), dim=-1)
    kl = (teacher.exp() * (teacher - student_topk)).sum(-1)
    ce = -target_logprobs
    loss = (1.0 - ce_weight) * kl + ce_weight * ce
    metrics = {
        "distill/forward_kl": masked_mean(kl.detach(), response_mask),
        "distill/ce": masked_mean(ce.detach(), response_mask),
    }
    return loss * response_mask, metrics
