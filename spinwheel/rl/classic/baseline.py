"""The value baseline of VPG and TRPO: advantage normalisation and the critic's regression on reward-to-go.

References: Spinning Up's VPG and TRPO (after each policy step the value function is fitted by MSE to the
discounted reward-to-go over several epochs of minibatches); Huang et al., "The 37 Implementation Details of
PPO" (2022) for normalising advantages (PPO uses :func:`normalize_advantages` per minibatch).

Data parallel: statistics are global (every rank normalises with the same mean and std) and each minibatch is
drawn over the global rollout, with gradients summed over ranks (see ``data_parallel.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spinwheel.rl.classic.buffer import Batch
from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.optim import FlatAdam
from spinwheel.rl.classic.policies import ActorCritic
from spinwheel.rl.losses import value_loss


def normalize_advantages(advantages: Tensor, dp: DataParallel) -> Tensor:
    """``(A - mean) / (std + 1e-8)`` with the mean and unbiased std over every rank's ``advantages`` ``(B,)``."""
    mean, std = dp.mean_std(advantages)
    return (advantages - mean.float()) / (std.float() + 1e-8)


def fit_value(
    critic: nn.Module,
    optimizer: FlatAdam,
    obs: Tensor,
    targets: Tensor,
    epochs: int,
    minibatch_size: int,
    num_envs: int,
    generator: torch.Generator,
    dp: DataParallel,
) -> float:
    """Regress ``critic(obs)`` on ``targets`` by MSE: ``epochs`` passes of shuffled minibatches.

    ``obs`` ``(B, obs_dim)`` / ``targets`` ``(B,)`` are this rank's flattened rollout; minibatches are drawn over
    the global rollout. Returns the mean loss of the last epoch.
    """
    num_samples = obs.shape[0] * dp.world_size
    last = torch.zeros(())
    for _ in range(epochs):
        perm = torch.randperm(num_samples, generator=generator)
        epoch_loss, count = torch.zeros(()), 0
        for start in range(0, num_samples, minibatch_size):
            global_idx = perm[start : start + minibatch_size]
            idx = dp.local_indices(global_idx, num_envs)
            optimizer.zero_grad()
            if idx.numel() > 0:
                loss, _ = value_loss(critic(obs[idx]).squeeze(-1), targets[idx])
                share = idx.numel() / global_idx.numel()
                (loss * share).backward()
                epoch_loss += loss.detach() * share
            dp.sum_(optimizer.grad)
            optimizer.step()
            count += 1
        last = epoch_loss / count
    return dp.sum(last).item()


class ValueBaseline:
    """What VPG and TRPO share around their policy step: the critic's Adam, the rollout's advantages (normalised
    with ``--norm-adv``), and the critic's fit to the reward-to-go after the step."""

    def __init__(self, policy: ActorCritic, config: ClassicConfig, dp: DataParallel):
        self.policy, self.config, self.dp = policy, config, dp
        self.critic_optimizer = FlatAdam(policy.critic.parameters(), lr=config.vf_lr)

    def advantages(self, batch: Batch) -> Tensor:
        return normalize_advantages(batch.advantages, self.dp) if self.config.norm_adv else batch.advantages

    def fit_critic(self, batch: Batch, num_envs: int, generator: torch.Generator, lr_scale: float) -> float:
        """:func:`fit_value` on this rank's rollout at the scheduled learning rate; the last epoch's mean loss."""
        cfg = self.config
        self.critic_optimizer.lr = cfg.vf_lr * lr_scale
        return fit_value(
            self.policy.critic,
            self.critic_optimizer,
            batch.obs,
            batch.rewards_to_go,
            cfg.update_epochs,
            cfg.minibatch_size,
            num_envs,
            generator,
            self.dp,
        )
