"""The critic's loss, per token: ``(loss (B, T), metrics)``, aggregation left to ``aggregate``.

``values`` (B, T) are the critic's current predictions (with gradient), ``old_values`` (B, T) its
predictions when the advantages were computed (no gradient), ``returns`` (B, T) the targets
(GAE's R_t = A_t + V_t), ``response_mask`` bool (B, T). Values follow ``token_logprobs``'
alignment: ``values[b, t]`` is V of the state before response token ``t`` (see
``token_values``), which is what ``gae_advantages`` reads.

Metrics are detached scalar tensors over this micro-batch's masked tokens: ``critic/vf_clipfrac``
(fraction of tokens where the clipped term was the larger), ``critic/value_mean`` and
``critic/explained_variance`` (1 - Var[R - V] / Var[R]: 1 is perfect, 0 no better than a constant).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reroll.algorithms.aggregation import masked_mean, masked_var

Metrics = dict[str, Tensor]


def token_values(scores: Tensor) -> Tensor:
    """V(x_<t), the value of the state before token ``t``: ``(B, T, 1)`` value-head scores -> ``(B, T)``; column 0 is 0.

    Aligned like ``token_logprobs``: at a response token ``t``, the value belongs to the state in
    which the policy chose token ``t`` (the output at position ``t - 1``), which is the V_t that
    ``gae_advantages`` reads in delta_t = r_t + gamma V_{t+1} - V_t. The output at the last token
    (the state after the response) is never used: the value after the last token is 0.
    """
    return torch.nn.functional.pad(scores[:, :-1, 0].float(), (1, 0), value=0.0)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip: float | None = 0.2,
    eps: float = 1e-8,
) -> tuple[Tensor, Metrics]:
    """l_t = 0.5 max((V_t - R_t)^2, (clip(V_t, V_old - c, V_old + c) - R_t)^2): (B, T) -> (B, T).

    PPO's clipped value loss (Schulman et al., arXiv 1707.06347; the OpenAI baselines PPO2
    implementation). The clipped term keeps the critic's update within ``clip`` of the values
    the advantages were computed with; ``clip=None`` gives the plain 0.5 (V_t - R_t)^2.
    ``eps`` is added to Var[R] in the explained variance.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        loss = 0.5 * unclipped
        clipfrac = torch.zeros((), device=values.device)
    else:
        clipped_values = old_values + (values - old_values).clamp(min=-clip, max=clip)
        clipped = (clipped_values - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    detached = values.detach()
    residual_var = masked_var(returns - detached, response_mask)
    metrics = {
        "critic/vf_clipfrac": clipfrac,
        "critic/value_mean": masked_mean(detached, response_mask),
        "critic/explained_variance": 1.0 - residual_var / (masked_var(returns, response_mask) + eps),
    }
    return loss, metrics
