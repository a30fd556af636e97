"""Returns and advantages: discounted cumulative sums, reward-to-go and GAE-λ.

References: Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
(2016); Pardo et al., "Time Limits in Reinforcement Learning" (2018) for bootstrapping at truncation.

All functions are pure tensor functions over a time-major layout: the first dimension is time ``T``, any
trailing dimensions (e.g. ``N`` parallel environments) are batch dimensions handled element-wise.
The backward recursion loops over ``T`` only; every step is one vectorised operation over the batch.

Episode boundaries are given by two boolean masks, following gymnasium's ``step`` API:

=============== ==================================================================================
``terminated``  the episode reached a terminal state: the future is worth 0, never bootstrap.
``truncated``   the episode was cut by a time limit (or the rollout ended): the future is worth
                ``V(s_{t+1})``, so bootstrap from the value of the final observation.
=============== ==================================================================================

Both stop the recursion from flowing across the boundary into the next episode.
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_scan(x: Tensor, coef: Tensor | float) -> Tensor:
    """``y[t] = x[t] + coef[t] * y[t+1]`` with ``y[T] = 0``, computed backwards over dimension 0.

    ``coef`` is a scalar or a tensor broadcastable to ``x``.

    >>> reverse_scan(torch.tensor([1., 1., 1.]), 0.5)
    tensor([1.7500, 1.5000, 1.0000])
    """
    if x.shape[0] == 0:
        return x.clone()
    coef = torch.as_tensor(coef, dtype=x.dtype, device=x.device).expand_as(x)
    xs, cs = x.unbind(0), coef.unbind(0)
    running = xs[-1]
    out = [running]
    for t in range(x.shape[0] - 2, -1, -1):
        running = torch.addcmul(xs[t], cs[t], running)  # one kernel per step
        out.append(running)
    return torch.stack(out[::-1])


def discount_cumsum(x: Tensor, discount: float) -> Tensor:
    """Discounted cumulative sum over dimension 0 (one episode, no boundaries).

    input ``[x0, x1, x2]`` → output ``[x0 + d·x1 + d²·x2,  x1 + d·x2,  x2]``.

    >>> discount_cumsum(torch.tensor([1., 2., 3.]), 0.5)
    tensor([2.7500, 3.5000, 3.0000])
    """
    return reverse_scan(x, discount)


def reward_to_go(
    rewards: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
) -> Tensor:
    """Discounted reward-to-go ``R[t] = r[t] + γ R[t+1]`` inside an episode, bootstrapped at cuts.

    At a cut (``truncated[t]``, e.g. a time limit or the end of the rollout) the tail is ``V(s_{t+1})``
    (``next_values[t]``); at ``terminated[t]`` it is 0. ``next_values`` is only read where the step is a
    cut, so it may hold anything elsewhere. Shapes: all ``(T, *B)``; returns ``(T, *B)``.

    Example, γ = 0.5, one env, episode terminates at t=1, a new one is truncated at t=2 with V(s3) = 4::

        rewards     [1, 1, 1]
        terminated  [0, 1, 0]
        truncated   [0, 0, 1]
        next_values [·, ·, 4]
        returns     [1.5, 1, 3]       # 1 + .5·1 ;  1 ;  1 + .5·4
    """
    terminated = terminated.to(rewards.dtype)
    done = torch.maximum(terminated, truncated.to(rewards.dtype))
    # The tail of an episode that was cut contributes γ·V(s_{t+1}) once, at the cut.
    x = rewards + gamma * (done - terminated).clamp(min=0) * next_values
    return reverse_scan(x, gamma * (1.0 - done))


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (GAE-λ); returns ``(advantages, returns)``.

    ``δ[t] = r[t] + γ (1 - terminated[t]) V(s_{t+1}) - V(s_t)`` and
    ``A[t] = δ[t] + γλ (1 - done[t]) A[t+1]`` with ``done = terminated | truncated``;
    ``returns = A + V`` (the λ-return, the value target).

    ``values[t]`` is ``V(s_t)``; ``next_values[t]`` is ``V(s_{t+1})`` where ``s_{t+1}`` is the observation the
    step produced (at a time limit: the final observation, not the reset one). Mark the last step of a
    rollout ``truncated`` if its episode goes on, so the recursion bootstraps from ``next_values`` there.
    Shapes: all ``(T, *B)``.

    Example, γ = λ = 0.5, values all 1, the episode terminates at t=1 and a new one is truncated at t=2::

        rewards     [1, 1, 1]          next_values [1, ·, 1]
        terminated  [0, 1, 0]          truncated   [0, 0, 1]
        δ           [.5, 0, .5]
        advantages  [.5, 0, .5]        returns     [1.5, 1, 1.5]

    With ``lam=1`` the returns equal :func:`reward_to_go`; with ``lam=0`` the advantages are the TD errors.
    """
    terminated = terminated.to(rewards.dtype)
    done = torch.maximum(terminated, truncated.to(rewards.dtype))
    deltas = rewards + gamma * (1.0 - terminated) * next_values - values
    advantages = reverse_scan(deltas, gamma * lam * (1.0 - done))
    return advantages, advantages + values


def normalize(x: Tensor, eps: float = 1e-8) -> Tensor:
    """Shift and scale to zero mean and unit (population) standard deviation.

    >>> normalize(torch.tensor([1., 2., 3.]))
    tensor([-1.2247,  0.0000,  1.2247])
    """
    return (x - x.mean()) / (x.std(unbiased=False) + eps)
