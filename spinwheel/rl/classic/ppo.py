"""PPO update: epochs of minibatch steps on a proximal surrogate, value loss and entropy bonus.

References: Schulman et al., "Proximal Policy Optimization Algorithms" (2017): the clipped surrogate (eq. 7,
``ppo_variant="clip"``) or the KL-penalised one with an adaptive β (§4, ``"penalty"``, see ``kl_penalty.py``);
Huang et al., "The 37 Implementation Details of Proximal Policy Optimization" (2022) for per-minibatch advantage
normalisation, global gradient clipping, learning-rate annealing and the approx-KL early stop.

Data parallel: every rank draws the same minibatch permutation of the *global* rollout and keeps the samples
it holds; each loss term is scaled by ``n_local / n_minibatch`` and the gradients are summed over ranks, so
each optimizer step equals the one-process step on the same minibatch (see ``data_parallel.py``). The penalty's
β changes from the KL averaged over every rank's samples, so it is the same on all ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spinwheel.rl.classic.baseline import normalize_advantages
from spinwheel.rl.classic.buffer import Batch
from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.kl_penalty import adapt_kl_coef, ppo_penalty_loss
from spinwheel.rl.classic.optim import FlatAdam
from spinwheel.rl.classic.policies import ActorCritic
from spinwheel.rl.losses import entropy_loss, ppo_clip_loss, value_loss

# Statistics averaged over minibatches, in this order; then clip_frac (clip) or the surrogate mean(r·A) (penalty).
_STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "approx_kl_k1")


class PPO:
    """Owns the optimizer (and the penalty's β); :meth:`update` consumes one rollout and returns its statistics."""

    def __init__(self, policy: ActorCritic, config: ClassicConfig, dp: DataParallel):
        self.policy, self.config, self.dp = policy, config, dp
        self.optimizer = FlatAdam(policy.parameters(), lr=config.lr, eps=1e-5)
        self.penalty = config.ppo_variant == "penalty"
        self.beta = config.penalty_beta

    def update(self, batch: Batch, num_envs: int, generator: torch.Generator, lr_scale: float) -> dict[str, float]:
        cfg, dp, actor = self.config, self.dp, self.policy.actor
        optimizer = self.optimizer
        optimizer.lr = cfg.lr * lr_scale
        num_samples = len(batch) * dp.world_size
        pd_old = None
        if self.penalty:  # the rollout policy's distributions, for the exact KL of the penalty
            with torch.no_grad():
                pd_old = actor(batch.obs)
        totals = torch.zeros(len(_STATS) + 1)
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
                    global_idx = perm[start : start + cfg.minibatch_size]
                    idx = dp.local_indices(global_idx, num_envs)
                    share = idx.numel() / global_idx.numel()  # this rank's share of the minibatch mean

                advantages = batch.advantages[idx]
                if cfg.norm_adv:
                    advantages = normalize_advantages(advantages, dp)
                optimizer.zero_grad()
                minibatch_stats = torch.zeros(len(_STATS) + 1)
                if share > 0:  # a rank may hold none of a small minibatch; it still joins the sum
                    loss, minibatch_stats = self.loss(batch, idx, advantages, pd_old)
                    (loss * share).backward()
                    minibatch_stats = minibatch_stats * share
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
        stats = {name: totals[i].item() for i, name in enumerate(_STATS)}
        stats["clip_frac" if pd_old is None else "surrogate"] = totals[-1].item()
        stats.update(num_minibatches=float(num_minibatches), stopped_early=float(stopped_early))
        if pd_old is not None:
            stats.update(self._adapt_beta(batch, pd_old))
        return stats

    def loss(
        self, batch: Batch, idx: Tensor | slice, advantages: Tensor, pd_old: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The combined objective of the minibatch ``batch[idx]``, to minimise; one backward serves actor and critic.

        ``L = L_policy + vf_coef · L_VF - ent_coef · S``: the negation of eq. 9 of Schulman et al. (2017),
        ``L^{CLIP+VF+S} = E[L^CLIP - c1 L^VF + c2 S]``, with ``L_policy`` the clipped surrogate's loss (or the KL
        penalty's when ``pd_old``, the rollout policy's distributions, is given), ``L_VF`` the squared error to the
        λ-returns (clipped around the rollout values with ``clip_range_vf``) and ``S`` the mean entropy.
        ``advantages`` are those of ``idx``, already normalised if configured. Returns ``(loss, stats)``, stats the
        detached ``_STATS`` vector then clip_frac (clip) or the surrogate (penalty).
        """
        cfg, actor = self.config, self.policy.actor
        pd = actor(batch.obs[idx])
        log_probs = actor.log_prob(pd, batch.actions[idx])
        values = self.policy.value(batch.obs[idx])
        if pd_old is None:
            pg_loss, pg_stats = ppo_clip_loss(log_probs, batch.log_probs[idx], advantages, cfg.clip_range)
            last_stat = pg_stats["clip_frac"]
        else:
            kl = actor.kl(pd_old[idx], pd)
            pg_loss, pg_stats = ppo_penalty_loss(log_probs, batch.log_probs[idx], advantages, kl, self.beta)
            last_stat = pg_stats["surrogate"]
        v_loss, _ = value_loss(values, batch.returns[idx], batch.values[idx], cfg.clip_range_vf)
        loss = pg_loss + cfg.vf_coef * v_loss
        if cfg.ent_coef != 0.0:
            ent_loss, _ = entropy_loss(actor.entropy(pd))
            loss = loss + cfg.ent_coef * ent_loss
        else:  # for the statistics only: keep it out of the graph
            ent_loss, _ = entropy_loss(actor.entropy(pd.detach()))
        kl_k3, kl_k1 = pg_stats["approx_kl"], pg_stats["approx_kl_k1"]
        stats = torch.stack([pg_loss.detach(), v_loss.detach(), -ent_loss.detach(), kl_k3, kl_k1, last_stat])
        return loss, stats

    def _adapt_beta(self, batch: Batch, pd_old: Tensor) -> dict[str, float]:
        """The rollout's mean KL(π_old ‖ π_new) after the update sets the next β (statistics of this update)."""
        actor = self.policy.actor
        with torch.no_grad():
            kl = self.dp.sum(actor.kl(pd_old, actor(batch.obs)).mean() / self.dp.world_size).item()
        beta = self.beta
        self.beta = adapt_kl_coef(beta, kl, self.config.penalty_kl_target)
        return {"kl": kl, "kl_beta": beta}
