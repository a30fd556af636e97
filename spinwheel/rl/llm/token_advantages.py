"""Advantages and per-token rewards for LLM post-training: GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++, PPO.

References: Shao et al., "DeepSeekMath" (2024) §4.1.2 for group-normalised outcome advantages; Liu et al.,
"Understanding R1-Zero-Like Training" (2025) for Dr. GRPO (no std scaling); Yu et al., "DAPO" (2025) for dynamic
sampling; Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (2019) and Ahmadian et al., "Back to
Basics" (2024) for RLOO; Hu et al., "REINFORCE++" (2025, arXiv:2501.03262) §3 for token returns with a KL
penalty, normalised over the global batch; Ziegler et al., "Fine-Tuning Language Models from Human Preferences"
(2019) §2.2 for the per-token KL reward and the adaptive KL coefficient; Schulman et al., GAE (2016).

**Layout.** Sequence rewards are ``(B,)`` with ``B = num_prompts · G`` and each prompt's ``G`` completions in
consecutive rows: rows ``g·G … g·G + G - 1`` are group ``g`` (the layout TRL's sampler produces; ``rewards.view(-1,
G)`` is the ``(num_prompts, G)`` table). Per-token tensors are ``(B, T)`` with a mask that is 1 on sampled tokens: one
contiguous run per row for a single-turn completion (right padding), runs separated by observation tokens (mask 0)
for a multi-turn episode. Everything here runs once per rollout batch on the whole
global batch (its statistics are batch-wide), never per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from spinwheel.rl.advantages import gae, reverse_scan


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """``(B,)`` rewards as the ``(num_prompts, G)`` table, with a readable error for a bad size."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,), got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group needs a second completion to compare), got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, scale_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages ``(r_i - mean_g) / (std_g + ε)`` per completion, (B,) → (B,).

    ``std_g`` is the *unbiased* (Bessel-corrected, ``G - 1``) standard deviation of the group, as TRL's
    ``rewards.view(-1, G).std(dim=1)`` (the GRPO paper does not say which). TRL's ε is 1e-4; pass ``eps=1e-4``
    to match it exactly. ``scale_std=False`` is Dr. GRPO: ``r_i - mean_g``. A group whose rewards are all
    equal gets advantage 0 either way.
    """
    table = _groups(rewards, group_size).double()  # a float32 group's sum may overflow (four rewards of 3e38)
    centred = table - table.mean(dim=1, keepdim=True)
    if scale_std:
        centred = centred / (table.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).to(rewards.dtype)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out: ``r_i - mean_{j ≠ i} r_j`` over the completion's group, (B,) → (B,).

    Equal to ``G / (G - 1) · (r_i - mean_g)``; each sample's baseline is independent of its own reward, so the
    gradient stays unbiased.
    """
    table = _groups(rewards, group_size).double()  # the group's sum in float64: a float32 one may overflow
    others = (table.sum(dim=1, keepdim=True) - table) / (group_size - 1)
    return (table - others).reshape(-1).to(rewards.dtype)


def dynamic_sampling_mask(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: bool (B,), True for the rows of groups whose rewards are not all equal.

    A group with equal rewards has zero advantage under GRPO and RLOO and only adds KL gradient; DAPO drops it
    (and samples more prompts to fill the batch). Exact comparison (max == min), not a std threshold.
    """
    table = _groups(rewards, group_size)
    keep = table.amax(dim=1) != table.amin(dim=1)  # (num_prompts,)
    return keep.repeat_interleave(group_size)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Masked whitening ``(x - mean) / sqrt(var + ε)`` over the masked entries of ``x`` (any shape).

    ``var`` is unbiased (Bessel-corrected), as TRL's and verl's ``masked_whiten``; ``shift_mean=False`` adds the
    mean back (only scales). Entries outside the mask come out 0; with a single masked entry its variance is
    taken as 0 (its whitened value is 0).
    """
    x64, m = x.double(), mask.double()  # sums of float32 returns may overflow float32 (3e38 each)
    count = m.sum()
    mean = (x64 * m).sum() / count.clamp(min=1)
    var = ((x64 - mean).pow(2) * m).sum() / (count - 1).clamp(min=1)  # one entry: var 0, the output 0
    out = (x64 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return (out * m).to(x.dtype)


def final_token_mask(mask: Tensor) -> Tensor:
    """Float (B, T), 1 at each row's last masked position (a row's final completion token), 0 elsewhere."""
    m = mask.to(torch.float32) if not mask.is_floating_point() else mask
    on = m != 0
    counts = on.cumsum(dim=1)
    return (on & (counts == counts[:, -1:])).to(m.dtype)


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token PPO rewards (Ziegler et al. 2019): ``-β · KL_t`` on every sampled token, plus the rewards.

    ``scores`` (B,): a sequence score, put on each row's final sampled token; or (B, T): rewards already at their
    tokens (a multi-turn episode's per-turn rewards, each at its turn's last sampled token:
    :func:`~spinwheel.rl.llm.episode_tokens.episode_batch`'s ``turn_rewards``). ``kl`` (B, T) a per-token KL
    estimate to the reference, usually k1 ``log π_old - log π_ref``
    (:func:`spinwheel.rl.llm.token_losses.kl_per_token`); ``mask`` (B, T), 1 on sampled tokens. Returns (B, T), 0
    outside the mask; a row without tokens gets no score (there is no token to put it on).
    """
    m = mask.to(kl.dtype)
    placed = scores.to(kl.dtype) if scores.dim() == 2 else scores.to(kl.dtype).unsqueeze(1) * final_token_mask(m)
    return (placed - beta * kl) * m


def token_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """GAE-λ over each row's sampled tokens; returns ``(advantages, returns)``, both (B, T), 0 outside the mask.

    ``rewards`` (B, T) from :func:`token_rewards`, ``values`` (B, T) the critic's ``V(s_t)`` for the state before
    each token. The steps of the MDP are the masked (sampled) tokens only: where the mask has gaps (a multi-turn
    episode's observation tokens) the recursion jumps over them, so the step after sampled token t is the next
    *sampled* token t' and ``δ_t = r_t + γ V(s_t') - V(s_t)`` (``s_t'`` holds the observation the environment fed
    in between; its tokens are neither rewarded nor discounted), as verl's and RAGEN's multi-turn GAE skip them. The
    episode ends at its last sampled token (the value after it is 0, also for episodes cut by a turn or token limit,
    as TRL's PPO does); ``returns = advantages + values`` are the value targets (the λ-return). Rewards or values on
    unmasked positions are ignored. Each row's sampled tokens are packed to the left (order kept), run through
    :func:`spinwheel.rl.advantages.gae` with the rows as its batch dimension, and scattered back.
    """
    on = mask != 0
    order = torch.argsort((~on).to(torch.int8), dim=1, stable=True)  # per row: sampled positions first, in order
    counts = on.sum(dim=1, keepdim=True)
    packed = (torch.arange(mask.shape[1], device=mask.device) < counts).to(values.dtype)
    r, v = rewards.gather(1, order) * packed, values.gather(1, order) * packed
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)  # V at the next sampled token; 0 after the last
    done = final_token_mask(packed)
    adv, ret = gae(r.T, v.T, next_v.T, done.T, torch.zeros_like(done).T, gamma, lam)
    unpack = lambda x: torch.zeros_like(values).scatter(1, order, x.T * packed)  # noqa: E731
    return unpack(adv), unpack(ret)


def reinforce_pp_advantages(
    scores: Tensor,
    kl: Tensor,
    mask: Tensor,
    beta: float,
    gamma: float = 1.0,
    group_size: int | None = None,
) -> Tensor:
    """REINFORCE++ advantages (Hu et al. 2025, arXiv:2501.03262), (B, T).

    Per-token rewards ``r_t = score · 1[t = last] - β · KL_t`` (:func:`token_rewards`, with ``KL_t = log π_old -
    log π_ref``, the paper's k1), discounted returns ``G_t = Σ_{k ≥ t} γ^{k-t} r_k`` (the paper has γ = 1:
    ``A_t = score - β Σ_{k ≥ t} KL_k``), then :func:`whiten` over every completion token of the global batch.
    With ``group_size`` this is "REINFORCE++ w/ baseline": each score first has its group's mean subtracted
    (Dr. GRPO's centring) before the global whitening. Shapes as :func:`token_rewards`; 0 outside the mask.
    """
    scores, kl64 = scores.double(), kl.double()  # in float64: centred scores and returns may pass float32's range
    if group_size is not None:
        scores = group_advantages(scores, group_size, scale_std=False)
    m = mask.to(torch.float64)
    returns = reverse_scan(token_rewards(scores, kl64, m, beta).T, gamma).T * m
    return whiten(returns, m).to(kl.dtype)


@dataclass
class FixedKLController:
    """A constant KL coefficient β; ``update`` does nothing (same interface as :class:`AdaptiveKLController`)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """Proportional controller of the KL coefficient (Ziegler et al. 2019, §2.2):
    ``β ← β · (1 + clip(KL / target - 1, -0.2, 0.2) · n_steps / horizon)``.

    ``value`` is the current β (initialised with the starting coefficient); ``target`` the desired KL per
    sequence; ``horizon`` how many samples it takes to correct a 20% error by about e (10000 in the paper).
    ``update`` is called once per rollout batch with the measured KL and the number of samples in it.
    """

    value: float
    target: float
    horizon: float = 10000.0

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"the KL target and horizon must be > 0, got {self.target} and {self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
