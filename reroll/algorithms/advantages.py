"""Advantage estimators: pure functions over tensors, no config object, no host syncs.

Shapes: ``rewards`` (B,) is one scalar per sequence; ``group_ids`` (B,) names the prompt each
sample was drawn for (any integers); per-token tensors are (B, T) with ``response_mask``
bool (B, T). Sequence-level estimators return (B,); the caller broadcasts them over the
response tokens. Token-level estimators return ``(advantages, returns)``, both (B, T) and
zero outside the mask.

A sample alone in its group has no baseline to compare against and gets advantage 0 from
the group estimators (GRPO, RLOO), never its raw reward.

The ``estimate_*`` functions at the end give the config-selected estimators one calling
convention: an ``AdvantageInputs`` of tensors plus keyword hyperparameters, returning
``(advantages (B, T), returns (B, T) | None)``. ``ADV_ESTIMATORS`` maps the config names to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from reroll.algorithms.aggregation import group_mean, group_std, group_sum_count, masked_var, masked_whiten
from reroll.algorithms.naming import UnknownAlgorithmError, unknown_name_message

StdScale = Literal["group", "batch", "none"]


def outcome_to_tokens(rewards: Tensor, response_mask: Tensor) -> Tensor:
    """r_it = r_i on the last response token of sequence i, else 0: (B,), (B, T) -> (B, T)."""
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(response_mask, positions, -1).amax(dim=-1, keepdim=True)  # (B, 1), -1 if empty
    on_last = positions == last
    return torch.where(on_last, rewards.unsqueeze(-1), 0.0)


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_scale: StdScale = "group",
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """A_i = (r_i - mean_g r) / (std + eps): (B,) -> (B,). GRPO, DeepSeekMath (arXiv 2402.03300).

    ``std_scale``: ``group`` divides by the unbiased std of the sample's group (GRPO);
    ``none`` leaves the centred reward (Dr. GRPO, arXiv 2503.20783); ``batch`` divides by the
    std of the rewards over the ``valid`` samples of the batch (Lite PPO's group-mean /
    batch-std, arXiv 2508.08221). ``valid`` (B,) bool defaults to every sample.
    """
    centered = rewards - group_mean(rewards, group_ids)
    if std_scale == "none":
        return centered
    if std_scale == "group":
        return centered / (group_std(rewards, group_ids) + eps)
    if std_scale == "batch":
        valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
        return centered / (torch.sqrt(masked_var(rewards, valid, unbiased=True)) + eps)
    raise UnknownAlgorithmError(unknown_name_message("std_scale", std_scale, ["group", "batch", "none"]))


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1): (B,) -> (B,). RLOO (Ahmadian et al., arXiv 2402.14740).

    Equal to n_g / (n_g - 1) * (r_i - mean_g r); 0 for a sample alone in its group.
    """
    sums, counts = group_sum_count(rewards, group_ids)
    leave_one_out = (sums - rewards) / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, rewards - leave_one_out, torch.zeros_like(rewards))


def remax_advantages(rewards: Tensor, baseline_rewards: Tensor) -> Tensor:
    """A_i = r_i - r(greedy response to prompt i): (B,), (B,) -> (B,). ReMax (Li et al., arXiv 2310.10505)."""
    return rewards - baseline_rewards


def raft_advantages(rewards: Tensor, *, correct_threshold: float = 0.5) -> Tensor:
    """A_i = 1[r_i > threshold]: (B,) -> (B,). RAFT++ (Xiong et al., arXiv 2504.11343) trains on positives only.

    Pair it with ``raft_mask`` so that the incorrect samples also leave the loss's token count.
    """
    return (rewards > correct_threshold).to(rewards.dtype)


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t; R_t = A_t + V_t. (B, T) -> 2x (B, T).

    GAE (Schulman et al., arXiv 1506.02438). Positions outside the mask (padding, or the
    environment's tokens between the turns of a multi-turn episode) are skipped: t + 1 means
    the next response token, and the value after the last one is 0.
    """
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        on = response_mask[:, t]
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, adv_t, next_adv)
        advantages[:, t] = adv_t
    advantages = torch.where(response_mask, advantages, 0.0)
    returns = torch.where(response_mask, advantages + values, 0.0)
    return advantages, returns


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + gamma G_{t+1} over the response tokens (others skipped): (B, T) -> (B, T), zero outside the mask."""
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[-1])):
        on = response_mask[:, t]
        running = torch.where(on, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(response_mask, returns, 0.0)


def reinforce_pp_advantages(
    token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """A_t = whiten_batch(G_t), G_t = sum_{s>=t} gamma^(s-t) r_s: (B, T) -> 2x (B, T). REINFORCE++ (Hu, arXiv 2501.03262).

    ``token_rewards`` carries the outcome reward on the last token and, when the KL penalty is
    in the reward, -beta * KL_t on every token. Mean and std are over the masked tokens of
    the whole batch (global advantage normalisation).
    """
    returns = discounted_returns(token_rewards, response_mask, gamma=gamma)
    return masked_whiten(returns, response_mask, eps=eps), returns


def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    *,
    token_penalty: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """A_t = whiten_batch(G_t) with the outcome r_i - mean_g r on the last token: (B,), (B,), (B, T) -> 2x (B, T).

    REINFORCE++-baseline (Hu, arXiv 2501.03262; OpenRLHF ``reinforce_baseline``): the group
    mean is subtracted from the outcome reward only; ``token_penalty`` (B, T) (e.g. the KL
    penalty -beta * KL_t) is added per token before the returns are accumulated.
    """
    centered = outcome_to_tokens(rewards - group_mean(rewards, group_ids), response_mask)
    token_rewards = centered if token_penalty is None else centered + token_penalty
    return reinforce_pp_advantages(token_rewards, response_mask, gamma=gamma, eps=eps)


def steps_from_tokens(token_values: Tensor, step_ids: Tensor, num_steps: int) -> Tensor:
    """v_ik = sum of token_values[i, t] over the tokens with step_ids[i, t] == k: (B, T) -> (B, S); ids < 0 ignored."""
    index = step_ids.clamp(min=0)
    values = torch.where(step_ids >= 0, token_values, torch.zeros_like(token_values))
    out = torch.zeros(token_values.shape[0], num_steps, dtype=token_values.dtype, device=token_values.device)
    return out.scatter_add_(1, index, values)


def tokens_from_steps(step_values: Tensor, step_ids: Tensor) -> Tensor:
    """x_it = step_values[i, step_ids[i, t]], 0 where step_ids < 0: (B, S), (B, T) -> (B, T)."""
    gathered = step_values.gather(1, step_ids.clamp(min=0))
    return torch.where(step_ids >= 0, gathered, torch.zeros_like(gathered))


def step_discounted_returns(step_rewards: Tensor, step_mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """G_k = r_k + gamma G_{k+1} over the turns of an episode (absent turns skipped): (B, S) -> (B, S)."""
    return discounted_returns(step_rewards, step_mask, gamma=gamma)


def step_return_advantages(
    step_rewards: Tensor,
    step_ids: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """A_t = whiten_batch(G_{k(t)}), G_k = sum_{j>=k} gamma^(j-k) r_j over turns: (B, S), (B, T) -> 2x (B, T).

    Multi-turn episodes: ``step_ids`` (B, T) gives the turn k of each response token (-1 for
    prompt, environment and padding tokens); ``step_rewards`` (B, S) the reward of each turn
    (the outcome reward on the last turn). Every token of turn k gets its turn's discounted
    return, whitened over the batch's response tokens. ``gigpo_advantages`` normalises within
    groups of equal anchor states instead.
    """
    step_mask = steps_from_tokens(response_mask.to(step_rewards.dtype), step_ids, step_rewards.shape[1]) > 0
    step_returns = step_discounted_returns(step_rewards, step_mask, gamma=gamma)
    mask = response_mask & (step_ids >= 0)
    returns = torch.where(mask, tokens_from_steps(step_returns, step_ids), 0.0)
    return masked_whiten(returns, mask, eps=eps), returns


def step_group_ids(group_ids: Tensor, step_states: Tensor) -> Tensor:
    """Dense ids of (episode group, state) pairs: (B,), (B, S) -> (B, S); -1 where step_states < 0.

    Two turns share a step group when their episodes share a group (same seed) and they acted in the
    same state (equal ``step_states`` ids, e.g. a hash of the observation): GiGPO's anchor states.
    """
    valid = step_states >= 0
    pairs = torch.stack([group_ids.unsqueeze(-1).expand_as(step_states)[valid], step_states[valid]], dim=-1)
    out = torch.full_like(step_states, -1)
    if pairs.numel():
        out[valid] = torch.unique(pairs, dim=0, return_inverse=True)[1]
    return out


def gigpo_advantages(
    episode_returns: Tensor,
    group_ids: Tensor,
    step_returns: Tensor,
    step_states: Tensor,
    *,
    step_weight: float = 1.0,
    std_scale: StdScale = "group",
    eps: float = 1e-6,
) -> Tensor:
    """A_ik = A^E_i + w * A^S_ik: (B,), (B,), (B, S), (B, S) -> (B, S). GiGPO (Feng et al., arXiv 2505.10978).

    A^E_i is the GRPO advantage of episode i's return within its group (episodes of one seed);
    A^S_ik the GRPO advantage of turn k's discounted return G_ik within its step group (the turns of
    the group's episodes taken in the same state, ``step_group_ids``). A state seen once has
    A^S = 0. ``step_states`` < 0 marks absent turns, which get 0.
    """
    episode = grpo_advantages(episode_returns, group_ids, std_scale=std_scale, eps=eps)
    steps = step_group_ids(group_ids, step_states)
    valid = steps >= 0
    step_adv = torch.zeros_like(step_returns)
    if valid.any():
        flat = step_returns[valid]
        step_adv[valid] = grpo_advantages(
            flat, steps[valid], std_scale=std_scale, eps=eps, valid=torch.ones_like(flat, dtype=torch.bool)
        )
    return torch.where(valid, episode.unsqueeze(-1) + step_weight * step_adv, 0.0)


# ---- one calling convention for the config-selected estimators ----


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may read. (B,) per sequence, (B, T) per token."""

    raw_rewards: Tensor  # (B,) as the reward functions returned them
    rewards: Tensor  # (B,) after shaping (overlong penalty, normalisation, clipping)
    scores: Tensor  # (B,) rewards + sum_t kl_rewards: what sequence-level estimators compare
    token_rewards: Tensor  # (B, T) rewards on the last response token + kl_rewards
    group_ids: Tensor  # (B,)
    mask: Tensor  # bool (B, T): response tokens of the samples the filters kept
    kl_rewards: Tensor | None = None  # (B, T) -beta * KL_t when the KL is in the reward
    values: Tensor | None = None  # (B, T) critic values, for gae
    baseline_rewards: Tensor | None = None  # (B,) greedy response's reward, for remax
    step_ids: Tensor | None = None  # long (B, T) turn of each token, -1 outside turns
    step_rewards: Tensor | None = None  # (B, S) reward of each turn
    step_states: Tensor | None = None  # long (B, S) state id each turn acted in, -1 if absent


Estimate = tuple[Tensor, Tensor | None]  # advantages (B, T), returns (B, T) or None


def _per_token(seq_advantages: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, seq_advantages.unsqueeze(-1), 0.0)


def estimate_gae(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0) -> Estimate:
    """``gae_advantages`` on the token rewards and the critic's values."""
    if x.values is None:
        raise ValueError("adv_estimator 'gae' needs the critic's values: pass values (B, T)")
    return gae_advantages(x.token_rewards, x.values, x.mask, gamma=gamma, lam=lam)


def estimate_grpo(x: AdvantageInputs, *, std_scale: StdScale = "group", eps: float = 1e-6) -> Estimate:
    """``grpo_advantages`` of the scores, batch statistics over the kept samples, on every response token."""
    seq = grpo_advantages(x.scores, x.group_ids, std_scale=std_scale, eps=eps, valid=x.mask.any(dim=-1))
    return _per_token(seq, x.mask), None


def estimate_rloo(x: AdvantageInputs) -> Estimate:
    """``rloo_advantages`` of the scores, on every response token."""
    return _per_token(rloo_advantages(x.scores, x.group_ids), x.mask), None


def estimate_remax(x: AdvantageInputs) -> Estimate:
    """``remax_advantages``: the score minus the greedy response's reward (shaped the same way by the caller)."""
    if x.baseline_rewards is None:
        raise ValueError(
            "adv_estimator 'remax' needs the greedy response's reward: pass baseline_rewards (B,)"
        )
    return _per_token(remax_advantages(x.scores, x.baseline_rewards.to(x.scores.dtype)), x.mask), None


def estimate_raft(x: AdvantageInputs, *, correct_threshold: float = 0.5) -> Estimate:
    """``raft_advantages`` of the raw rewards (correctness is the verifier's, before shaping)."""
    seq = raft_advantages(x.raw_rewards.to(torch.float32), correct_threshold=correct_threshold)
    return _per_token(seq, x.mask), None


def estimate_reinforce_pp(x: AdvantageInputs, *, gamma: float = 1.0) -> Estimate:
    """``reinforce_pp_advantages`` on the token rewards."""
    return reinforce_pp_advantages(x.token_rewards, x.mask, gamma=gamma)


def estimate_reinforce_pp_baseline(x: AdvantageInputs, *, gamma: float = 1.0) -> Estimate:
    """``reinforce_pp_baseline_advantages``: group-centred shaped reward plus the per-token KL penalty."""
    return reinforce_pp_baseline_advantages(
        x.rewards, x.group_ids, x.mask, token_penalty=x.kl_rewards, gamma=gamma
    )


def estimate_step_return(x: AdvantageInputs, *, gamma: float = 1.0) -> Estimate:
    """``step_return_advantages``; without step_ids the response is one turn, without step_rewards the
    token rewards (outcome and KL penalty) are summed per turn."""
    step_ids = torch.where(x.mask, 0, -1) if x.step_ids is None else x.step_ids
    step_rewards = x.step_rewards
    if step_rewards is None:
        step_rewards = steps_from_tokens(x.token_rewards, step_ids, x.token_rewards.shape[-1])
    return step_return_advantages(step_rewards, step_ids, x.mask, gamma=gamma)


def estimate_gigpo(
    x: AdvantageInputs,
    *,
    gamma: float = 1.0,
    step_weight: float = 1.0,
    std_scale: StdScale = "group",
    eps: float = 1e-6,
) -> Estimate:
    """``gigpo_advantages`` of the scores and the turns' discounted returns, each token given its turn's value."""
    if x.step_ids is None or x.step_rewards is None or x.step_states is None:
        raise ValueError(
            "adv_estimator 'gigpo' needs multi-turn episodes: pass step_ids (B, T), step_rewards (B, S) and "
            "step_states (B, S) (the agentic pipeline does)"
        )
    step_mask = x.step_states >= 0
    step_returns = step_discounted_returns(x.step_rewards, step_mask, gamma=gamma)
    per_step = gigpo_advantages(
        x.scores,
        x.group_ids,
        step_returns,
        x.step_states,
        step_weight=step_weight,
        std_scale=std_scale,
        eps=eps,
    )
    mask = x.mask & (x.step_ids >= 0)
    returns = torch.where(mask, tokens_from_steps(step_returns, x.step_ids), 0.0)
    return torch.where(mask, tokens_from_steps(per_step, x.step_ids), 0.0), returns


ADV_ESTIMATORS = {
    "gae": estimate_gae,
    "grpo": estimate_grpo,
    "rloo": estimate_rloo,
    "reinforce_pp": estimate_reinforce_pp,
    "reinforce_pp_baseline": estimate_reinforce_pp_baseline,
    "remax": estimate_remax,
    "raft": estimate_raft,
    "step_return": estimate_step_return,
    "gigpo": estimate_gigpo,
}
