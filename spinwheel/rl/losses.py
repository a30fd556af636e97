"""Policy-gradient losses and KL estimators as pure functions returning ``(value, stats)``.

References: Williams (1992) REINFORCE; Schulman et al., "Proximal Policy Optimization Algorithms" (2017),
eq. (7) for the clipped surrogate; J. Schulman, "Approximating KL Divergence" (2020) for the k1/k2/k3
estimators.

Every loss is a mean over the samples it is given and is to be *minimised*. ``stats`` holds detached scalar
tensors (call ``.item()`` when logging; they are not synced eagerly so the hot path stays cheap).
All inputs are 1-D ``(B,)`` tensors of per-sample quantities unless noted. The ``*_terms`` functions return the
per-sample terms before the mean, for callers that aggregate with their own weights (the LLM token losses in
``spinwheel.rl.llm.token_losses``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Stats = dict[str, Tensor]


KLEstimator = Literal["k1", "k2", "k3"]


def approx_kl_terms(logp_new: Tensor, logp_old: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-sample Monte-Carlo terms of ``KL(old ‖ new)`` for actions sampled by the old policy; same shape as inputs.

    With ``log r = logp_new - logp_old``: ``k1 = -log r`` (unbiased, high variance, can be negative),
    ``k2 = ½ (log r)²`` (biased, low variance; close to the KL while the two policies are close) and
    ``k3 = (r - 1) - log r`` (unbiased, never negative, lower variance).
    """
    log_ratio = logp_new - logp_old
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'")


def approx_kl(logp_new: Tensor, logp_old: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Monte-Carlo estimate of ``KL(old ‖ new)`` from actions sampled by the old policy.

    The mean of :func:`approx_kl_terms`; see there for the estimators.
    """
    return approx_kl_terms(logp_new, logp_old, estimator).mean()


def policy_gradient_loss(logp: Tensor, advantages: Tensor) -> tuple[Tensor, Stats]:
    """Vanilla policy gradient: ``-mean(log π(a|s) · A)``; its gradient is the REINFORCE estimator."""
    loss = -(logp * advantages).mean()
    return loss, {"policy_loss": loss.detach()}


def ppo_clip_terms(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """Per-sample PPO loss ``-min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)``.

    ``eps_low != eps_high`` is DAPO's clip-higher (Yu et al. 2025); PPO itself has ``eps_low == eps_high``.
    """
    return -torch.minimum(ratio * advantages, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages)


def ppo_clip_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip_range: float) -> tuple[Tensor, Stats]:
    """PPO clipped surrogate: ``-mean(min(r·A, clip(r, 1-ε, 1+ε)·A))`` with ``r = π_new / π_old``.

    stats: ``policy_loss``, ``approx_kl`` (k3), ``approx_kl_k1``, ``clip_frac`` (share of samples with
    ``|r - 1| > ε``), ``ratio_mean``.
    """
    log_ratio = logp_new - logp_old
    ratio = log_ratio.exp()
    loss = ppo_clip_terms(ratio, advantages, clip_range, clip_range).mean()
    with torch.no_grad():
        stats = {
            "policy_loss": loss.detach(),
            "approx_kl": ((ratio - 1.0) - log_ratio).mean(),
            "approx_kl_k1": (-log_ratio).mean(),
            "clip_frac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "ratio_mean": ratio.mean(),
        }
    return loss, stats


def value_loss_terms(
    values: Tensor,
    returns: Tensor,
    old_values: Tensor | None = None,
    clip_range: float | None = None,
) -> Tensor:
    """Per-sample ``(V - R)²``, or with ``clip_range`` (needs ``old_values``) the pessimistic clipped form
    ``max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²)``; same shape as ``values``."""
    unclipped = (values - returns).pow(2)
    if clip_range is None:
        return unclipped
    if old_values is None:
        raise ValueError("value clipping needs old_values (the values predicted at rollout time)")
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    return torch.maximum(unclipped, (clipped_values - returns).pow(2))


def value_loss(
    values: Tensor,
    returns: Tensor,
    old_values: Tensor | None = None,
    clip_range: float | None = None,
) -> tuple[Tensor, Stats]:
    """Mean squared error ``mean((V - R)²)``, optionally clipped around the rollout-time values.

    With ``clip_range`` (needs ``old_values``): ``mean(max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²))``,
    the pessimistic value loss of the PPO reference implementation (OpenAI baselines ``ppo2``).
    """
    loss = value_loss_terms(values, returns, old_values, clip_range).mean()
    return loss, {"value_loss": loss.detach()}


def entropy_loss(entropy: Tensor) -> tuple[Tensor, Stats]:
    """``-mean(H)``: adding ``coef ·`` this to a loss is the entropy bonus."""
    mean = entropy.mean()
    return -mean, {"entropy": mean.detach()}


def explained_variance(predicted: Tensor, target: Tensor) -> Tensor:
    """``1 - Var(target - predicted) / Var(target)``: 1 is a perfect value fit, 0 no better than a constant.

    Returns NaN when the target has no variance.
    """
    var = target.var(unbiased=False)
    if var == 0:
        return torch.tensor(float("nan"))
    return 1.0 - (target - predicted).var(unbiased=False) / var
