"""Off-policy corrections for rollouts sampled by older weights than the trainer's (asynchronous RL), as pure
functions.

References: Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning System" (arXiv 2505.24298), §5.2
for the **decoupled PPO objective** — three policies: the *behaviour* policy π_behav that sampled the tokens (the
engine's log-probs), the *proximal* policy π_prox the update clips around (the trainer's weights at the start of the
update: the loop's old-policy log-probs), and π_θ being trained::

    J(θ) = Σ w · (π_prox / π_behav) · min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A),   r = π_θ / π_prox

TRL's ``vllm_importance_sampling_mode="sequence_mask"`` for **sequence-level masked IS** (MIS): a sequence whose
importance ratio ``Π_t π_prox / π_behav`` leaves a range is dropped from the loss; MiniMax, "MiniMax-M1" (arXiv
2506.13585), §3.1 for **CISPO**: the clipped importance weight, stop-gradient, multiplies a REINFORCE term, so no
token's gradient is clipped away::

    loss = −Σ w · sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π_θ

Also the staleness of asynchronous rollouts' tokens (:func:`token_versions`, :func:`staleness_figures`).

Shapes: ``B`` rows, ``T`` positions; per-token tensors (B, T); ``mask`` (B, T) 1 on sampled tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spinwheel.rl.llm.episode_tokens import Episode
from spinwheel.rl.llm.token_losses import _per_token, _weighted_token_loss, clipped_policy_loss, truncated_is_weights
from spinwheel.rl.losses import Stats


def sequence_is_mask(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """MIS: 1 for the rows (B,) whose sequence ratio ``exp(Σ_t m·(log π_prox − log π_behav))`` lies in
    ``[1/cap, cap]``, 0 for the others (dropped from the loss); detached."""
    if cap < 1:
        raise ValueError(f"the sequence importance-ratio cap must be >= 1, got {cap}")
    m = mask.detach() != 0
    log_ratio = torch.where(m, prox_logp.detach() - behav_logp.detach(), 0.0).sum(-1)  # (B,)
    return (log_ratio.abs() <= math.log(cap)).to(prox_logp.dtype)


def off_policy_weights(
    prox_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    stale: Tensor | None = None,
    tis_cap: float | None = None,
    mis_cap: float | None = None,
) -> Tensor | None:
    """The per-token weights (B, T) that multiply the surrogate, detached; None where none applies.

    * ``stale`` (B, T, nonzero on tokens sampled by older weights than the proximal policy's): decoupled PPO's
      behaviour weight ``π_prox / π_behav`` on those tokens, 1 on the others — a token the current weights sampled
      has π_behav = π_prox up to the sampler's numerics, which the synchronous loop ignores too;
    * ``tis_cap`` C: ``min(π_prox / π_behav, C)`` on *every* token (truncated IS; it then also caps the stale ones);
    * ``mis_cap``: times :func:`sequence_is_mask` (rows outside ``[1/cap, cap]`` weigh 0).

    No stale token and neither cap: None (the synchronous loop's surrogate, untouched).
    """
    any_stale = stale is not None and bool((stale != 0).any())
    if not any_stale and tis_cap is None and mis_cap is None:
        return None
    weights = truncated_is_weights(prox_logp, behav_logp, tis_cap) if tis_cap is not None else None
    if any_stale and weights is None:
        assert stale is not None
        live = stale != 0
        weights = torch.where(live, (prox_logp - behav_logp).detach(), 0.0).exp()  # 1 where fresh
    if weights is None:
        weights = torch.ones_like(prox_logp)
    if mis_cap is not None:
        weights = weights * sequence_is_mask(prox_logp, behav_logp, mask, mis_cap)[:, None]
    return weights


def decoupled_policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    cap: float | None = None,
) -> tuple[Tensor, Stats]:
    """AReaL's decoupled PPO loss (module docstring), negated, every token treated as off-policy: the clipped
    surrogate around ``prox_logp`` weighted by ``π_prox / π_behav`` (``min(·, cap)`` with ``cap``). The loop gets
    the same loss from :func:`~spinwheel.rl.llm.token_losses.clipped_policy_loss` with
    :func:`off_policy_weights`; this spells it out in one call."""
    everywhere = (weights != 0).to(prox_logp.dtype)  # every weighted token is stale
    is_weights = off_policy_weights(prox_logp, behav_logp, weights, everywhere, tis_cap=cap)
    return clipped_policy_loss(logp, prox_logp, advantages, weights, eps_low, eps_high, is_weights)


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.2,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """CISPO (module docstring): ``−Σ w · ρ · sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π`` with
    ``r = exp(logp − old_logp)`` and optional extra weights ``ρ`` (the off-policy ones). Its gradient is the
    clipped-weight policy gradient on every token, including those PPO's clip would silence.

    stats: ``policy_loss``, ``clip_frac`` (tokens whose weight was clipped), ``ratio_mean``, ``approx_kl`` (k3 of
    ``KL(π_old ‖ π)``), ``weight_sum``, ``is_weight_mean`` (with ``is_weights``).
    """
    adv = _per_token(advantages)
    log_ratio = torch.where(weights != 0, logp - old_logp, 0.0).detach()
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    terms = -clipped * adv * torch.where(weights != 0, logp, 0.0)
    clip_frac = {"clip_frac": (clipped != ratio).to(weights.dtype)}
    return _weighted_token_loss(terms, weights, is_weights, log_ratio, ratio, clip_frac)


def token_versions(episodes: list[Episode], width: int, step: int) -> torch.Tensor:
    """(B, T) long: the version that sampled each label position (``width`` = T), ``step`` where the episode
    recorded none (the synchronous loop) and off the sampled tokens."""
    rows = torch.full((len(episodes), width), step, dtype=torch.long)
    for i, e in enumerate(episodes):
        positions = [j - 1 for j, m in enumerate(e.mask) if m and j >= 1]
        if e.versions and len(e.versions) == len(positions):
            rows[i, positions] = torch.tensor(e.versions, dtype=torch.long)
    return rows


def staleness_figures(
    versions: torch.Tensor, mask: torch.Tensor, step: int, max_staleness: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """(keep (B,): 0 for the rows whose oldest sampled token is more than ``max_staleness`` versions behind
    ``step``, and the figures: ``dropped_samples``, ``staleness_mean`` / ``staleness_max`` over the kept tokens and
    ``staleness/<k>`` the share of kept tokens k versions behind)."""
    behind = (step - versions).clamp(min=0) * (mask != 0)  # (B, T)
    keep = (behind.amax(1) <= max_staleness).to(mask.dtype)
    trained = (mask != 0) & (keep[:, None] != 0)
    values = behind[trained]
    figures = {"dropped_samples": float((keep == 0).sum())}
    if values.numel():
        figures.update(staleness_mean=float(values.float().mean()), staleness_max=float(values.max()))
        for k, n in zip(*torch.unique(values, return_counts=True)):
            figures[f"staleness/{int(k)}"] = float(n) / values.numel()
    return keep, figures
