"""Losses on preference pairs (prompt, chosen, rejected): the reward model's Bradley-Terry loss and the
DPO family. Pure functions of per-pair tensors ``(P,)``; each returns ``(per-pair loss (P,), metrics)``
and the caller reduces (sums over the pairs of a micro-batch divided by the step's pair count).

Sequence scores come from ``sequence_logprob``: the sum of a response's token log-probs under the
policy (``(B, T)`` -> ``(B,)``). docs/algorithms.md gives every loss with its formula and paper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
"""The ``dpo.loss`` names; 'simpo' is reference-free and length-normalised."""


def sequence_logprob(token_logprobs: Tensor, response_mask: Tensor, *, average: bool = False) -> Tensor:
    """sum_t m_t log p(y_t | x, y_<t) per row: ``(B, T)`` log-probs and mask -> ``(B,)``; ``average``:
    divided by the row's response length |y| (SimPO's length normalisation)."""
    mask = response_mask.to(token_logprobs.dtype)
    total = (token_logprobs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def bradley_terry_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, *, margin: float = 0.0, center_coef: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """-log sigmoid(r_c - r_r - margin) + center_coef * (r_c + r_r)^2, per pair ``(P,)`` (Bradley & Terry
    1952; the reward-model loss of Ouyang et al. 2022, InstructGPT). ``margin``: a pair must win by it
    (Llama 2's margin loss); ``center_coef``: keeps rewards centred on zero (the centring term of
    Eisenstein et al. 2023, "Helping or herding?").

    Metrics (unreduced, ``(P,)``): ``accuracy`` (r_c > r_r), ``margin`` r_c - r_r."""
    diff = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(diff - margin)
    if center_coef:
        loss = loss + center_coef * (chosen_rewards + rejected_rewards) ** 2
    return loss, {"accuracy": (diff > 0).to(diff.dtype), "margin": diff.detach()}


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor | None,
    ref_rejected: Tensor | None,
    *,
    loss: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO family's per-pair loss ``(P,)`` from sequence log-probs ``(P,)``.

    With h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)):

    - 'sigmoid' (DPO, Rafailov et al. 2023): -log sigmoid(beta h); with eps = label_smoothing > 0 the
      conservative DPO of Mitchell 2023 (cDPO), -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    - 'ipo' (Azar et al. 2023): (h - 1 / (2 beta))^2
    - 'hinge' (SLiC, Zhao et al. 2023): max(0, 1 - beta h)
    - 'robust' (robust DPO, Chowdhury et al. 2024: unbiased under a share eps = label_smoothing < 0.5
      of flipped labels),
      [-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)] / (1 - 2 eps)
    - 'simpo' (Meng et al. 2024, reference-free): -log sigmoid(beta (l_c - l_r) - gamma) with ``policy_*``
      the length-averaged log-probs l and ``ref_*`` unused (None)

    Metrics ``(P,)``: ``rewards/chosen`` beta (log pi - log ref) of y_c (SimPO: beta l_c),
    ``rewards/rejected`` the same for y_r, ``margins`` their difference, ``accuracy`` margins > 0.
    """
    if loss not in DPO_LOSSES:
        raise ValueError(f"unknown DPO loss {loss!r}; the DPO losses are {list(DPO_LOSSES)}")
    if loss == "simpo":
        chosen, rejected = policy_chosen, policy_rejected
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"DPO loss {loss!r} needs the reference log-probs; only 'simpo' goes without")
        chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    h = chosen - rejected
    eps = label_smoothing
    if loss == "sigmoid":
        per_pair = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss == "ipo":
        per_pair = (h - 1.0 / (2.0 * beta)) ** 2
    elif loss == "hinge":
        per_pair = torch.relu(1.0 - beta * h)
    elif loss == "robust":
        per_pair = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    else:  # simpo
        per_pair = -F.logsigmoid(beta * h - simpo_gamma)
    rewards_c, rewards_r = beta * chosen.detach(), beta * rejected.detach()
    margins = rewards_c - rewards_r
    return per_pair, {
        "rewards/chosen": rewards_c,
        "rewards/rejected": rewards_r,
        "margins": margins,
        "accuracy": (margins > 0).to(margins.dtype),
    }
