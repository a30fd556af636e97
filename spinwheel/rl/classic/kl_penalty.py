"""PPO-Penalty: the KL-penalised surrogate and its adaptive coefficient, as pure functions.

Reference: Schulman et al., "Proximal Policy Optimization Algorithms" (2017), §4. The objective (eq. 8) is

    L^KLPEN(θ) = Ê[ r_t(θ) Â_t − β · KL[π_old(·|s_t), π_θ(·|s_t)] ],  r_t = π_θ(a_t|s_t) / π_old(a_t|s_t),

maximised over several epochs of minibatch steps. After each policy update the mean KL ``d`` over the rollout
sets the next β: ``d < d_targ / 1.5`` halves it, ``d > 1.5 · d_targ`` doubles it (the paper's constants).

The KL is the exact per-state divergence of the two action distributions (the actor's closed form), not a
sample estimate. Loss and statistics follow :mod:`spinwheel.rl.losses` (``(value, stats)``, to be minimised);
the functions live here until the LLM trainers need them too, when they can move to ``rl/losses.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

Stats = dict[str, Tensor]


def ppo_penalty_loss(
    logp_new: Tensor, logp_old: Tensor, advantages: Tensor, kl: Tensor, beta: float
) -> tuple[Tensor, Stats]:
    """``-mean(r·A) + β·mean(KL)``, the negated L^KLPEN. Inputs ``(B,)``; ``kl[i] = KL(π_old ‖ π_θ)`` at s_i.

    stats: ``policy_loss`` (the whole loss), ``surrogate`` (``mean(r·A)``), ``kl`` (``mean(KL)``), ``approx_kl``
    (k3 estimate from the log-ratio, comparable to PPO-clip's), ``approx_kl_k1``, ``ratio_mean``.
    """
    log_ratio = logp_new - logp_old
    ratio = log_ratio.exp()
    surrogate = (ratio * advantages).mean()
    mean_kl = kl.mean()
    loss = -surrogate + beta * mean_kl
    with torch.no_grad():
        stats = {
            "policy_loss": loss.detach(),
            "surrogate": surrogate.detach(),
            "kl": mean_kl.detach(),
            "approx_kl": ((ratio - 1.0) - log_ratio).mean(),
            "approx_kl_k1": (-log_ratio).mean(),
            "ratio_mean": ratio.mean(),
        }
    return loss, stats


def adapt_kl_coef(beta: float, kl: float, kl_target: float) -> float:
    """The next β after an update whose mean KL was ``kl``: ×½ below ``kl_target / 1.5``, ×2 above 1.5·kl_target.

    ``kl_target == 0`` keeps β fixed (the paper's "fixed KL coefficient" baseline).
    """
    if kl_target == 0:
        return beta
    if kl < kl_target / 1.5:
        return beta / 2.0
    if kl > kl_target * 1.5:
        return beta * 2.0
    return beta
