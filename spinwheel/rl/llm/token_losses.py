"""Per-token policy and value losses for LLM post-training (GRPO, Dr. GRPO, DAPO, PPO), as pure functions.

References: Shao et al., "DeepSeekMath" (2024), eq. (3) for GRPO's clipped surrogate with a per-token KL to the
reference; Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective" (2025) for Dr. GRPO's
constant normaliser; Yu et al., "DAPO" (2025) for clip-higher (``eps_low != eps_high``) and the token-level mean;
J. Schulman, "Approximating KL Divergence" (2020) for the k1/k2/k3 estimators; Yao et al., "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training" (2025) for truncated importance sampling.

**The aggregation contract.** Every loss here is ``Σ_{i,t} w_it · ℓ_it``: linear in the per-token terms ``ℓ``
with weights ``w`` from :func:`token_weights`, computed once from the mask of the *whole global batch*. A trainer
that splits the rows over data-parallel ranks and micro-batches slices ``w`` with the rows; the per-shard losses
then *add up* to the full-batch loss (and so do their gradients), whatever the shards' sizes and lengths. So
shard losses are summed, never averaged: a DDP-style gradient mean over ``dp_size`` ranks must be multiplied back
by ``dp_size``. Stats are weighted sums with the same ``w`` for the same reason; with the first two aggregation
modes ``Σ w = 1`` and they are means, and ``weight_sum`` (``Σ w`` over the shard) lets a caller normalise them
under Dr. GRPO's weights.

Shapes: ``B`` rows (completions), ``T`` token positions; per-token tensors are ``(B, T)``, the log-probs of the
sampled completion tokens; positions outside the mask (weight 0) may hold any finite values: the losses ignore
them, also where ``exp`` of their differences would overflow.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from spinwheel.rl.losses import KLEstimator, Stats, approx_kl_terms, ppo_clip_terms, value_loss_terms

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def token_weights(
    mask: Tensor, mode: Aggregation, max_len: int | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """Per-token weights ``w`` (B, T) of a loss aggregation, from the global batch's completion mask (B, T).

    - ``token-mean``: ``w_it = m_it / Σ m`` (DAPO; TRL ``bnpo``, and ``dapo`` on one process);
    - ``seq-mean-token-mean``: ``w_it = m_it / (len_i · B')`` (the GRPO paper; TRL ``grpo``);
    - ``seq-mean-token-sum-norm``: ``w_it = m_it / (B · L)`` (Dr. GRPO; TRL ``dr_grpo``).

    ``len_i = Σ_t m_it``; ``B'`` counts the rows with at least one token, so ``Σ w = 1`` for the first two modes
    (TRL divides by every row instead; the two agree unless a completion is empty). Dr. GRPO's normaliser is a
    constant: ``B`` is every row and ``L = max_len`` (the generation budget) or ``T``. Rows without tokens get
    weight 0 in every mode. ``mask`` may be bool, integer or float (fractional values weight tokens). Returns
    weights of ``dtype`` (default: the mask's float dtype, float32 for a bool or integer mask), no gradient.
    """
    m = mask.detach()
    m = m.to(dtype or (m.dtype if m.is_floating_point() else torch.float32))
    if m.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(m.shape)}")
    if mode == "token-mean":
        return m / m.sum().clamp(min=1e-12)
    if mode == "seq-mean-token-mean":
        lengths = m.sum(dim=1, keepdim=True)  # (B, 1)
        num_rows = (lengths > 0).sum().clamp(min=1)
        return m / (lengths.clamp(min=1e-12) * num_rows)
    if mode == "seq-mean-token-sum-norm":
        length = m.shape[1] if max_len is None else max_len
        if length < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        return m / (m.shape[0] * length)
    raise ValueError(
        f"unknown aggregation {mode!r}; use 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'"
    )


def kl_per_token(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of ``KL(π ‖ π_ref)`` on tokens sampled from π; same shape as ``logp``.

    With ``Δ = log π - log π_ref``: ``k1 = Δ``, ``k2 = ½ Δ²``, ``k3 = exp(-Δ) + Δ - 1`` (the one GRPO uses,
    DeepSeekMath eq. (4); TRL's ``per_token_kl``). The same estimators as :func:`spinwheel.rl.losses.approx_kl`
    with π as the sampling policy.
    """
    return approx_kl_terms(ref_logp, logp, estimator)


def truncated_is_weights(trainer_logp: Tensor, engine_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights ``min(π_trainer / π_engine, C)`` per token, detached.

    Corrects for the sampler and the trainer disagreeing on the log-probs of the same weights (bf16, other
    kernels): the tokens were drawn from the engine's distribution, the loss assumes the trainer's. ``trainer_logp``
    are the trainer's old-policy log-probs, ``engine_logp`` the engine's for the same tokens (B, T). Computed as
    ``exp(min(Δ, log C))`` so a large Δ cannot overflow.
    """
    if cap <= 0:
        raise ValueError(f"the importance-sampling cap must be > 0, got {cap}")
    log_cap = torch.log(torch.tensor(cap, dtype=trainer_logp.dtype, device=trainer_logp.device))
    return (trainer_logp - engine_logp).detach().clamp(max=log_cap).exp()


def logprob_mismatch(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> Stats:
    """``mismatch_max`` and ``mismatch_mean`` of ``|Δ log p|`` between trainer and engine over masked tokens.

    ~0 in fp32, not in bf16: the figure that says whether :func:`truncated_is_weights` is needed.
    """
    with torch.no_grad():
        m = mask.bool()
        delta = (trainer_logp - engine_logp).abs()[m]
        if delta.numel() == 0:
            zero = delta.new_zeros(())
            return {"mismatch_max": zero, "mismatch_mean": zero}
        return {"mismatch_max": delta.max(), "mismatch_mean": delta.mean()}


def _per_token(advantages: Tensor) -> Tensor:
    """Sequence advantages (B,) broadcast over tokens; per-token (B, T) advantages as they are."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """PPO / GRPO clipped surrogate per token, aggregated with ``weights``: ``Σ w · ρ · (-min(r·A, clip(r)·A))``.

    ``r = exp(logp - old_logp)`` clipped to ``[1 - eps_low, 1 + eps_high]`` (clip-higher when they differ);
    ``ρ`` are optional truncated importance-sampling weights (:func:`truncated_is_weights`), 1 when omitted.
    Shapes: ``logp``, ``old_logp`` (detached), ``weights``, ``is_weights`` (B, T); ``advantages`` (B, T) or (B,).

    stats (weighted sums with ``w``): ``policy_loss``; ``clip_frac_low`` (tokens with ``r < 1 - eps_low`` and
    ``A < 0``), ``clip_frac_high`` (``r > 1 + eps_high`` and ``A > 0``), ``clip_frac`` (their sum): where the
    clip is active and the token's gradient is zero, as TRL counts it; ``approx_kl`` (k3 estimate of
    ``KL(π_old ‖ π)``), ``ratio_mean``, ``is_weight_mean`` (with ``is_weights``), ``weight_sum`` (``Σ w``).
    """
    adv = _per_token(advantages)
    log_ratio = torch.where(weights != 0, logp - old_logp, 0.0)  # padding cannot overflow exp into 0 · inf
    ratio = log_ratio.exp()
    terms = ppo_clip_terms(ratio, adv, eps_low, eps_high)  # (B, T)
    low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(weights.dtype)
    high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(weights.dtype)
    clipped = {"clip_frac_low": low, "clip_frac_high": high, "clip_frac": low + high}
    return _weighted_token_loss(terms, weights, is_weights, log_ratio, ratio, clipped)


def _weighted_token_loss(
    terms: Tensor,
    weights: Tensor,
    is_weights: Tensor | None,
    log_ratio: Tensor,
    ratio: Tensor,
    clipped: dict[str, Tensor],
) -> tuple[Tensor, Stats]:
    """``Σ w · ρ · terms`` over (B, T) tokens and the stats every token-level policy loss logs (weighted sums with
    ``w``): ``policy_loss``, each (B, T) 0/1 indicator of ``clipped`` under its name, ``approx_kl`` (k3 estimate of
    ``KL(π_old ‖ π)`` from ``log_ratio``), ``ratio_mean``, ``weight_sum``, ``is_weight_mean`` (with ``is_weights``,
    the ``ρ``; 1 when omitted)."""
    if is_weights is not None:
        terms = terms * is_weights.detach()
    loss = (weights * terms).sum()
    with torch.no_grad():
        w = weights.detach()
        stats = {
            "policy_loss": loss.detach(),
            **{name: (w * indicator).sum() for name, indicator in clipped.items()},
            "approx_kl": (w * (torch.expm1(log_ratio) - log_ratio)).sum(),
            "ratio_mean": (w * ratio).sum(),
            "weight_sum": w.sum(),
        }
        if is_weights is not None:
            stats["is_weight_mean"] = (w * is_weights).sum()
    return loss, stats


def _with_kl_penalty(
    loss: Tensor,
    stats: Stats,
    logp: Tensor,
    ref_logp: Tensor | None,
    weights: Tensor,
    beta: float,
    kl_estimator: KLEstimator,
) -> tuple[Tensor, Stats]:
    """``loss + β · Σ w · KL_t`` to the frozen reference (``KL_t``: :func:`kl_per_token`, 0 on padding whatever it
    holds); ``stats`` gains ``kl`` whenever ``ref_logp`` is given (logged at β = 0 too) and ``loss``."""
    if ref_logp is not None:
        live_logp = torch.where(weights != 0, logp, ref_logp)
        kl = (weights * kl_per_token(live_logp, ref_logp, kl_estimator)).sum()
        stats["kl"] = kl.detach()
        if beta != 0.0:
            loss = loss + beta * kl
    elif beta != 0.0:
        raise ValueError(f"beta = {beta} needs ref_logp (the reference model's log-probs)")
    stats["loss"] = loss.detach()
    return loss, stats


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kl_estimator: KLEstimator = "k3",
    is_weights: Tensor | None = None,
    level: Literal["token", "sequence"] = "token",
) -> tuple[Tensor, Stats]:
    """GRPO loss (DeepSeekMath eq. (3), negated): ``Σ w · (ρ · (-min(r·A, clip(r)·A)) + β · KL_t)``.

    ``KL_t`` is :func:`kl_per_token` of ``logp`` against the frozen reference ``ref_logp`` (B, T); the
    importance weights ``ρ`` multiply the surrogate only, not the KL term (as TRL applies its vLLM correction).
    ``ref_logp`` may be omitted when ``beta == 0``. With ``weights`` from ``token_weights(mask,
    "seq-mean-token-mean")`` this is the paper's ``1/G Σ_i 1/|o_i| Σ_t``; Dr. GRPO is ``"seq-mean-token-sum-norm"``
    weights with advantages from ``group_advantages(..., scale_std=False)``; DAPO is ``"token-mean"`` with
    ``eps_high > eps_low`` and ``beta = 0``. ``level="sequence"`` is GSPO (the ratio and its clip per sequence:
    :func:`sequence_clipped_policy_loss`, as TRL's ``importance_sampling_level``).

    stats: those of the surrogate, plus ``kl`` (``Σ w · KL_t``, when ``ref_logp`` is given) and ``loss``.
    """
    surrogate = clipped_policy_loss if level == "token" else sequence_clipped_policy_loss
    loss, stats = surrogate(logp, old_logp, advantages, weights, eps_low, eps_high, is_weights)
    return _with_kl_penalty(loss, stats, logp, ref_logp, weights, beta, kl_estimator)


def sequence_clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    weights: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Stats]:
    """GSPO's surrogate (Zheng et al. 2025, arXiv 2507.18071, eqs. (5)–(7), negated): the importance ratio and its
    clip are per *sequence*: ``s_i = (π(y_i|x) / π_old(y_i|x))^(1/|y_i|) = exp(mean_t (logp − old_logp))`` and
    ``loss = Σ_i ω_i · (-min(s_i·A_i, clip(s_i, 1 − eps_low, 1 + eps_high)·A_i))``.

    ``weights`` (B, T) from ``token_weights(mask, "seq-mean-token-mean")``: a row's weight ``ω_i = Σ_t w_it`` is the
    paper's ``1/G`` (over the global batch), and ``w_it / ω_i = 1/|y_i|`` averages the row's log-ratio; rows of
    weight 0 do not count. ``advantages`` (B,) or (B, T) holding the row's advantage on its tokens. Token-level
    importance weights do not apply to a sequence ratio (``is_weights`` must be None).

    stats: ``policy_loss``, ``clip_frac`` (weighted share of sequences whose clip is active), ``ratio_mean`` (of
    ``s_i``), ``approx_kl`` (token k3 of ``KL(π_old ‖ π)``), ``weight_sum``.
    """
    if is_weights is not None:
        raise ValueError("token-level importance weights do not apply to GSPO's sequence ratio; drop --tis-cap")
    row_w = weights.sum(-1)  # (B,)
    live = weights != 0
    inner = torch.where(live, weights / row_w.clamp_min(torch.finfo(weights.dtype).tiny)[:, None], 0.0)
    log_ratio = torch.where(live, logp - old_logp, 0.0)  # (B, T): padding cannot overflow exp
    log_s = (inner * log_ratio).sum(-1)  # (B,)
    s = log_s.exp()
    adv = advantages if advantages.dim() == 1 else (inner * advantages).sum(-1)
    loss = (row_w * ppo_clip_terms(s, adv, eps_low, eps_high)).sum()
    with torch.no_grad():
        w = row_w.detach()
        clipped = ((s < 1.0 - eps_low) & (adv < 0)) | ((s > 1.0 + eps_high) & (adv > 0))
        stats = {
            "policy_loss": loss.detach(),
            "clip_frac": (w * clipped.to(w.dtype)).sum(),
            "ratio_mean": (w * s).sum(),
            "approx_kl": (weights * (torch.expm1(log_ratio) - log_ratio)).sum(),
            "weight_sum": weights.sum(),
        }
    return loss, stats


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    weights: Tensor,
    clip: float | None = 0.2,
) -> tuple[Tensor, Stats]:
    """PPO value loss per token, aggregated with ``weights``: ``Σ w · max((V - R)², (V_clip - R)²)``.

    ``V_clip = V_old + clip(V - V_old, ±clip)`` (OpenAI baselines ``ppo2``; Ziegler et al. 2019); ``clip=None``
    gives ``Σ w · (V - R)²``. No factor ½: the same scale as :func:`spinwheel.rl.losses.value_loss` (TRL and
    baselines multiply by ½, i.e. their ``vf_coef`` is twice ours). Shapes: all (B, T).

    stats: ``value_loss``, ``value_clip_frac`` (``Σ w`` over tokens where the clipped branch is the larger),
    ``value_mean`` (``Σ w · V``).
    """
    terms = value_loss_terms(values, returns, old_values, clip)
    loss = (weights * terms).sum()
    with torch.no_grad():
        w = weights.detach()
        if clip is None:
            clipped = torch.zeros_like(w)
        else:
            clipped = (terms > (values - returns).pow(2)).to(w.dtype)
        stats = {"value_loss": loss.detach(), "value_clip_frac": (w * clipped).sum(), "value_mean": (w * values).sum()}
    return loss, stats
