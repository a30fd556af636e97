"""Preference losses: DPO (sigmoid, conservative / label-smoothed, IPO) and the Bradley–Terry reward-model loss.

References: Rafailov et al., "Direct Preference Optimization" (2023), eq. (7); Mitchell, "A Note on DPO with Noisy
Preferences & Relationship to IPO" (2023) for conservative DPO (label smoothing ε), as TRL defines it; Azar et al.,
"A General Theoretical Paradigm to Understand Learning from Human Preferences" (2023), eq. (17), for IPO, as TRL
implements it; Bradley & Terry (1952) and Ouyang et al., "Training Language Models to Follow Instructions with
Human Feedback" (2022) for the reward-model loss, with Touvron et al., "Llama 2" (2023) for its margin.

Inputs are per-pair tensors ``(B,)``. Each loss is ``Σ_i w_i ℓ_i`` with ``w`` uniform ``1/B`` unless given:
a trainer that shards the pairs passes ``weights = 1/B_global`` for its rows so the shards' losses add up to the
global one (the contract of :mod:`spinwheel.rl.llm.token_losses`). Stats are weighted sums with the same ``w``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from spinwheel.rl.losses import Stats


def _pair_weights(like: Tensor, weights: Tensor | None) -> Tensor:
    if weights is None:
        return torch.full_like(like.detach(), 1.0 / max(like.numel(), 1))
    return weights.detach()


def dpo_loss(
    pi_chosen: Tensor,
    pi_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
    label_smoothing: float = 0.0,
    weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """DPO loss over preference pairs; inputs (B,) log-probs of the chosen / rejected completions under the policy
    (``pi_*``, with gradient) and the frozen reference (``ref_*``).

    With ``h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)``:

    - ``sigmoid``: ``-(1 - ε) log σ(β h) - ε log σ(-β h)``; ``ε = label_smoothing`` is conservative DPO (the
      chosen label is wrong with probability ε), ``ε = 0`` the DPO paper's eq. (7);
    - ``ipo``: ``(h - 1 / (2β))²``, β playing IPO's τ.

    What to pass: for ``sigmoid`` the *summed* log-probs over each completion's tokens; for ``ipo`` TRL passes the
    *length-averaged* log-probs (sum / number of completion tokens), so pass those to match TRL's IPO.

    stats: ``rewards_chosen`` ``β (pi_chosen - ref_chosen)``, ``rewards_rejected``, ``margin`` (their
    difference), ``accuracy`` (share of pairs with ``rewards_chosen > rewards_rejected``), ``loss``.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    if loss_type == "sigmoid":
        if not 0.0 <= label_smoothing <= 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        if label_smoothing != 0.0:
            raise ValueError("label_smoothing applies to the sigmoid loss only; IPO has none")
        losses = (h - 1.0 / (2.0 * beta)).pow(2)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; use 'sigmoid' or 'ipo'")
    w = _pair_weights(losses, weights)
    loss = (w * losses).sum()
    with torch.no_grad():
        chosen = beta * (pi_chosen - ref_chosen)
        rejected = beta * (pi_rejected - ref_rejected)
        stats = {
            "loss": loss.detach(),
            "rewards_chosen": (w * chosen).sum(),
            "rewards_rejected": (w * rejected).sum(),
            "margin": (w * (chosen - rejected)).sum(),
            "accuracy": (w * (chosen > rejected).to(w.dtype)).sum(),
        }
    return loss, stats


def bradley_terry_loss(
    r_chosen: Tensor,
    r_rejected: Tensor,
    margin: Tensor | float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """Reward-model loss ``-log σ(r_chosen - r_rejected - margin)`` over pairs; scalar rewards (B,).

    Under the Bradley–Terry model ``P(chosen ≻ rejected) = σ(r_c - r_r)``, so this is the negative
    log-likelihood of the labels. ``margin`` (B,) or a scalar (Llama 2's preference-strength margin; TRL's
    ``margin`` column) asks the chosen reward to lead by at least that much; ``None`` is 0.

    stats: ``loss``, ``accuracy`` (share with ``r_c > r_r``), ``margin`` (``r_c - r_r``; the reward gap, not the
    required margin), ``rewards_chosen``, ``rewards_rejected``.
    """
    diff = r_chosen - r_rejected
    losses = -F.logsigmoid(diff if margin is None else diff - margin)
    w = _pair_weights(losses, weights)
    loss = (w * losses).sum()
    with torch.no_grad():
        stats = {
            "loss": loss.detach(),
            "accuracy": (w * (diff > 0).to(w.dtype)).sum(),
            "margin": (w * diff).sum(),
            "rewards_chosen": (w * r_chosen).sum(),
            "rewards_rejected": (w * r_rejected).sum(),
        }
    return loss, stats
