"""Vanilla policy gradient with a learned value baseline (REINFORCE with GAE-λ advantages).

References: Williams (1992); Sutton et al., "Policy Gradient Methods for RL with Function Approximation" (2000);
Spinning Up's VPG: one policy-gradient step per rollout, then the value function fitted by MSE to the
discounted reward-to-go.

Data parallel: the loss of each rank is its share of the global mean and the gradients are summed over ranks
(see ``data_parallel.py``); advantages are normalised with the global mean and std.
"""

from __future__ import annotations

import torch

from spinwheel.rl.classic.baseline import ValueBaseline
from spinwheel.rl.classic.buffer import Batch
from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.optim import FlatAdam
from spinwheel.rl.classic.policies import ActorCritic
from spinwheel.rl.losses import policy_gradient_loss


class VPG(ValueBaseline):
    """One Adam step on the policy-gradient loss per rollout, then the value fit."""

    def __init__(self, policy: ActorCritic, config: ClassicConfig, dp: DataParallel):
        super().__init__(policy, config, dp)
        self.actor_optimizer = FlatAdam(policy.actor.parameters(), lr=config.lr)

    def update(self, batch: Batch, num_envs: int, generator: torch.Generator, lr_scale: float) -> dict[str, float]:
        cfg, dp = self.config, self.dp
        self.actor_optimizer.lr = cfg.lr * lr_scale
        advantages = self.advantages(batch)
        share = 1.0 / dp.world_size  # every rank holds the same number of samples
        pd = self.policy.actor(batch.obs)
        log_probs = self.policy.actor.log_prob(pd, batch.actions)
        loss, stats = policy_gradient_loss(log_probs, advantages)
        self.actor_optimizer.zero_grad()
        (loss * share).backward()
        dp.sum_(self.actor_optimizer.grad)
        if cfg.max_grad_norm is not None:
            self.actor_optimizer.clip_grad_norm(cfg.max_grad_norm)
        self.actor_optimizer.step()
        with torch.no_grad():
            pd_new = self.policy.actor(batch.obs)
            kl = self.policy.actor.kl(pd.detach(), pd_new).mean()
            entropy = self.policy.actor.entropy(pd).mean()
        v_loss = self.fit_critic(batch, num_envs, generator, lr_scale)
        reduced = dp.sum(torch.stack([stats["policy_loss"], kl, entropy]) * share)
        return {
            "policy_loss": reduced[0].item(),
            "kl": reduced[1].item(),
            "entropy": reduced[2].item(),
            "value_loss": v_loss,
        }
