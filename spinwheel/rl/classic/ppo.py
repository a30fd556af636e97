"""PPO-clip update: epochs of minibatch steps on the clipped surrogate, value loss and entropy bonus.

References: Schulman et al., "Proximal Policy Optimization Algorithms" (2017); Huang et al., "The 37
Implementation Details of Proximal Policy Optimization" (2022) for per-minibatch advantage normalisation,
global gradient clipping, learning-rate annealing and the approx-KL early stop.

Data parallel: every rank draws the same minibatch permutation of the *global* rollout and keeps the samples
it holds; each loss term is scaled by ``n_local / n_minibatch`` and the gradients are summed over ranks, so
each optimizer step equals the one-process step on the same minibatch (see ``data_parallel.py``).
"""

from __future__ import annotations

import torch

from spinwheel.rl.classic.baseline import normalize_advantages
from spinwheel.rl.classic.buffer import Batch
from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.optim import FlatAdam
from spinwheel.rl.classic.policies import ActorCritic
from spinwheel.rl.losses import entropy_loss, ppo_clip_loss, value_loss


class PPO:
    """Owns the optimizer; :meth:`update` consumes one rollout and returns its statistics."""

    def __init__(self, policy: ActorCritic, config: ClassicConfig, dp: DataParallel):
        self.policy, self.config, self.dp = policy, config, dp
        self.optimizer = FlatAdam(policy.parameters(), lr=config.lr, eps=1e-5)

    def update(self, batch: Batch, num_envs: int, generator: torch.Generator, lr_scale: float) -> dict[str, float]:
        cfg, dp, actor = self.config, self.dp, self.policy.actor
        optimizer = self.optimizer
        optimizer.lr = cfg.lr * lr_scale
        num_samples = len(batch) * dp.world_size
        totals = torch.zeros(6)  # policy, value, entropy losses, approx_kl, approx_kl_k1, clip_frac
        num_minibatches = 0
        stopped_early = False
        full_batch = cfg.minibatch_size >= num_samples  # one minibatch per epoch: order is irrelevant
        for _ in range(cfg.update_epochs):
            perm = None if full_batch else torch.randperm(num_samples, generator=generator)
            for start in range(0, num_samples, cfg.minibatch_size):
                if perm is None:
                    global_idx, idx = None, slice(None)
                    share = 1.0 / dp.world_size  # ranks hold equal parts of the rollout
                else:
                    global_idx = perm[start:start + cfg.minibatch_size]
                    idx = dp.local_indices(global_idx, num_envs)
                    share = idx.numel() / global_idx.numel()  # this rank's share of the minibatch mean

                advantages = batch.advantages[idx]
                if cfg.norm_adv:
                    advantages = normalize_advantages(advantages, dp)
                optimizer.zero_grad()
                minibatch_stats = torch.zeros(6)
                if share > 0:  # a rank may hold none of a small minibatch; it still joins the sum
                    pd = actor(batch.obs[idx])
                    log_probs = actor.log_prob(pd, batch.actions[idx])
                    values = self.policy.value(batch.obs[idx])
                    pg_loss, pg_stats = ppo_clip_loss(log_probs, batch.log_probs[idx], advantages, cfg.clip_range)
                    v_loss, _ = value_loss(values, batch.returns[idx], batch.values[idx], cfg.clip_range_vf)
                    loss = pg_loss + cfg.vf_coef * v_loss
                    if cfg.ent_coef != 0.0:
                        ent_loss, _ = entropy_loss(actor.entropy(pd))
                        loss = loss + cfg.ent_coef * ent_loss
                    else:  # for the statistics only: keep it out of the graph
                        ent_loss, _ = entropy_loss(actor.entropy(pd.detach()))
                    (loss * share).backward()
                    minibatch_stats = torch.stack([pg_loss.detach(), v_loss.detach(), -ent_loss.detach(),
                                                   pg_stats["approx_kl"], pg_stats["approx_kl_k1"],
                                                   pg_stats["clip_frac"]]) * share
                dp.sum_(optimizer.grad)
                if cfg.max_grad_norm is not None:
                    optimizer.clip_grad_norm(cfg.max_grad_norm)
                optimizer.step()
                totals += minibatch_stats
                num_minibatches += 1
                if cfg.target_kl is not None and dp.sum(minibatch_stats[3]).item() > 1.5 * cfg.target_kl:
                    stopped_early = True
                    break
            if stopped_early:
                break
        totals = dp.sum(totals) / num_minibatches
        return {"policy_loss": totals[0].item(), "value_loss": totals[1].item(), "entropy": totals[2].item(),
                "approx_kl": totals[3].item(), "approx_kl_k1": totals[4].item(), "clip_frac": totals[5].item(),
                "num_minibatches": float(num_minibatches), "stopped_early": float(stopped_early)}
