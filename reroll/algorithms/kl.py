"""KL estimators between the policy and the reference, per token, and the adaptive KL controller.

With samples y ~ pi and log-ratio x = log pi(y) - log pi_ref(y), Schulman's estimators of
KL(pi || pi_ref) (http://joschu.net/blog/kl-approx.html) are k1 = x, k2 = x^2 / 2 and
k3 = exp(-x) - 1 + x. The log-ratio is clamped to +-``clamp`` before ``exp`` so that a
token the reference finds impossible cannot overflow.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from reroll.algorithms.naming import pick

KLEstimator = Literal["k1", "k2", "k3", "abs"]


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor, clamp: float) -> Tensor:
    return (logprobs - ref_logprobs).clamp(min=-clamp, max=clamp)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor, *, clamp: float = 20.0) -> Tensor:
    """k1 = log pi - log pi_ref: (B, T) -> (B, T). Unbiased, high variance, can be negative (Schulman 2020)."""
    return _log_ratio(logprobs, ref_logprobs, clamp)


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor, *, clamp: float = 20.0) -> Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2: (B, T) -> (B, T). Biased, low variance, >= 0; verl calls it ``mse``."""
    return 0.5 * _log_ratio(logprobs, ref_logprobs, clamp) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, *, clamp: float = 20.0) -> Tensor:
    """k3 = pi_ref/pi - 1 - log(pi_ref/pi): (B, T) -> (B, T). Unbiased, low variance, >= 0; verl's ``low_var_kl``.

    The estimator of the GRPO paper (DeepSeekMath, arXiv 2402.03300) for its KL loss.
    """
    neg = -_log_ratio(logprobs, ref_logprobs, clamp)  # log pi_ref - log pi
    return torch.exp(neg) - 1.0 - neg


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor, *, clamp: float = 20.0) -> Tensor:
    """|log pi - log pi_ref|: (B, T) -> (B, T). Biased, >= 0 (verl's ``abs``)."""
    return _log_ratio(logprobs, ref_logprobs, clamp).abs()


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, *, estimator: KLEstimator = "k3") -> Tensor:
    """KL_t estimated with ``estimator`` in {k1, k2, k3, abs}: (B, T), (B, T) -> (B, T)."""
    return pick("kl_estimator", KL_ESTIMATORS, estimator)(logprobs, ref_logprobs)


def kl_reward_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float | Tensor,
    estimator: KLEstimator = "k1",
) -> tuple[Tensor, Tensor]:
    """(-beta * KL_t, KL_t) on the response tokens, 0 elsewhere: (B, T) -> 2x (B, T).

    The token-level penalty added to the reward (InstructGPT, arXiv 2203.02155; Ziegler et al.,
    arXiv 1909.08593). Computed without gradient: it is part of the reward.
    """
    with torch.no_grad():
        kl = torch.where(response_mask, kl_penalty(logprobs, ref_logprobs, estimator=estimator), 0.0)
    return -kl_coef * kl, kl


def adaptive_kl_coef(
    kl_coef: float | Tensor,
    current_kl: float | Tensor,
    *,
    target: float,
    horizon: int,
    n_steps: int,
) -> Tensor:
    """beta' = beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon): scalars -> scalar tensor.

    The proportional controller of Ziegler et al. (arXiv 1909.08593): beta grows while the
    measured KL is above the target and shrinks while it is below.
    """
    error = torch.clamp(torch.as_tensor(current_kl, dtype=torch.float32) / target - 1.0, -0.2, 0.2)
    return torch.as_tensor(kl_coef, dtype=torch.float32) * (1.0 + error * n_steps / horizon)
