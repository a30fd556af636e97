"""TRPO and natural policy gradient for actor-critic policies.

References: Schulman et al., "Trust Region Policy Optimization" (2015); Kakade, "A Natural Policy Gradient"
(2001); Spinning Up's TRPO (value function fitted by MSE to the reward-to-go after each policy step).

The step itself lives in :mod:`spinwheel.rl.trpo` (generic over modules); this file supplies the closures:
the surrogate ``mean(π_θ(a|s) / π_old(a|s) · A)`` and the closed-form mean ``KL(π_old ‖ π_θ)`` over the
rollout's states. ``line_search=False`` gives the natural policy gradient: the KL-radius step, unchecked.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spinwheel.rl.classic.baseline import ValueBaseline
from spinwheel.rl.classic.buffer import Batch
from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.policies import ActorCritic
from spinwheel.rl.trpo import trust_region_step


class TRPO(ValueBaseline):
    """A trust-region step on the actor per rollout, then the value fit (Adam on the critic)."""

    def __init__(self, policy: ActorCritic, config: ClassicConfig, dp: DataParallel):
        super().__init__(policy, config, dp)
        self.actor_params = list(policy.actor.parameters())

    def update(self, batch: Batch, num_envs: int, generator: torch.Generator, lr_scale: float) -> dict[str, float]:
        cfg, dp, actor = self.config, self.dp, self.policy.actor
        advantages = self.advantages(batch)
        share = 1.0 / dp.world_size  # each closure returns this rank's share of the global mean
        with torch.no_grad():
            pd_old = actor(batch.obs)
            log_probs_old = actor.log_prob(pd_old, batch.actions)

        def surrogate() -> Tensor:
            ratio = torch.exp(actor.log_prob(actor(batch.obs), batch.actions) - log_probs_old)
            return (ratio * advantages).mean() * share

        def kl() -> Tensor:
            return actor.kl(pd_old, actor(batch.obs)).mean() * share

        stats = trust_region_step(
            self.actor_params,
            surrogate,
            kl,
            cfg.max_kl,
            cfg.cg_damping,
            cfg.cg_iters,
            line_search=cfg.line_search,
            backtrack_coef=cfg.backtrack_coef,
            max_backtracks=cfg.backtrack_iters,
            reduce=dp.sum,
        )
        with torch.no_grad():
            entropy = dp.sum(actor.entropy(actor(batch.obs)).mean() * share).item()
        v_loss = self.fit_critic(batch, num_envs, generator, lr_scale)
        return {**stats, "entropy": entropy, "value_loss": v_loss}
