"""A mixture-of-experts router's load-balancing loss and the experts' load: pure tensor functions.

The loss is Switch Transformer's (Fedus et al. 2021, eqs. 4-6) in the form transformers trains Qwen3-MoE,
Qwen2-MoE and Mixtral with (``load_balancing_loss_func``): over the real tokens of every MoE layer
pooled, ``f_e`` is expert ``e``'s share of the top-k assignments and ``P_e`` its mean router probability;
the loss ``E * sum_e f_e * P_e`` is ``top_k`` for an even load (``f_e = k/E``, ``P_e = 1/E``) and grows
as tokens crowd onto few experts. ``f`` is counted (no gradient); the gradient reaches the router
through ``P``.
"""

from __future__ import annotations

import math

import torch


def load_balance_loss(
    router_logits: torch.Tensor, token_mask: torch.Tensor | None, *, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``E * sum_e f_e * P_e`` over ``router_logits`` ``(L, N, E)`` (L MoE layers, N tokens of the forward
    flattened, E experts); ``token_mask`` ``bool[N]`` marks the real tokens (None: all). Returns the
    scalar loss and the top-k assignment counts ``(L, E)`` of the real tokens (the experts' load, for
    ``expert_load_stats``). Equal to transformers' ``load_balancing_loss_func`` on the same logits."""
    layers, tokens, experts = router_logits.shape
    mask = (
        torch.ones(tokens, device=router_logits.device)
        if token_mask is None
        else token_mask.reshape(-1).to(router_logits.device, torch.float32)
    )
    if mask.numel() != tokens:
        raise ValueError(f"token_mask has {mask.numel()} entries for router logits of {tokens} tokens")
    probs = torch.softmax(router_logits.float(), dim=-1)  # (L, N, E)
    chosen = torch.topk(probs.detach(), top_k, dim=-1).indices  # (L, N, k)
    counts = torch.zeros(layers, experts, device=probs.device)
    counts.scatter_add_(1, chosen.reshape(layers, -1), mask.repeat_interleave(top_k).expand(layers, -1))
    real = mask.sum() * layers  # token-layers counted
    f = counts.sum(0) / real  # (E,): top-k assignments per real token-layer (sums to top_k)
    p = (probs * mask[None, :, None]).sum((0, 1)) / real  # (E,): mean router probability
    return experts * (f * p).sum(), counts


def expert_load_stats(counts: torch.Tensor, *, top_k: int) -> dict[str, torch.Tensor]:
    """The experts' load from top-k assignment counts ``(L, E)`` (``load_balance_loss``'s, summed over a
    step's micro-batches). ``expert_load_max`` / ``expert_load_min``: the largest and smallest share of
    a layer's tokens routed to one expert, over every layer and expert (``counts * top_k /
    counts.sum(-1)``: an even load is ``top_k / E``, an expert every token picks 1);
    ``expert_load_entropy``: the entropy of each layer's assignments over ``ln E``, averaged over layers
    (1: even; 0 is out of reach with ``top_k`` > 1: ``ln top_k / ln E`` where every token picks the same)."""
    assignments = counts / counts.sum(-1, keepdim=True).clamp_min(1)  # each layer's sum to 1
    entropy = -(assignments * assignments.clamp_min(1e-12).log()).sum(-1) / math.log(counts.shape[-1])
    return {
        "expert_load_max": assignments.max() * top_k,
        "expert_load_min": assignments.min() * top_k,
        "expert_load_entropy": entropy.mean(),
    }
