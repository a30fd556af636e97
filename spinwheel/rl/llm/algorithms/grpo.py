"""The GRPO family: what each makes of a scored rollout batch (advantages) and the per-token loss it hands to the
trainer.

* **GRPO** (Shao et al. 2024, DeepSeekMath): group-normalised outcome advantages ``(r − mean_g) / std_g``, the
  clipped surrogate per token and ``β·KL(π‖π_ref)`` in the loss. Dr. GRPO (Liu et al. 2025) is
  ``--no-scale-rewards --loss-agg seq-mean-token-sum-norm``; DAPO's clip-higher is ``--eps-high > --eps-low``,
  its dynamic sampling ``--dynamic-sampling``.
* **RLOO** (Ahmadian et al. 2024): the leave-one-out baseline ``r_i − mean_{j≠i} r_j``, same loss.
* **REINFORCE++** (Hu et al. 2025): per-token returns with the KL to the reference *in the reward* (k1), whitened
  over the whole batch; the loss is the clipped surrogate without a KL term.

The math is in :mod:`spinwheel.rl.llm.token_advantages` and :mod:`spinwheel.rl.llm.token_losses` (tested against
the published formulas); this module only wires it.
"""

from __future__ import annotations

import torch

from spinwheel.parallel.token_outputs import TokenOutputs
from spinwheel.parallel.trainer import Batch
from spinwheel.rl.llm.algorithm_options import OPTIONS
from spinwheel.rl.llm.algorithms.base import Algorithm
from spinwheel.rl.llm.off_policy import off_policy_weights
from spinwheel.rl.llm.token_advantages import group_advantages, reinforce_pp_advantages, rloo_advantages
from spinwheel.rl.llm.token_losses import grpo_loss


class GroupPolicyGradient(Algorithm):
    """Outcome advantages from the group of G samples, the clipped surrogate per token, β·KL in the loss."""

    kl_in_loss = True
    ratio_level = "token"  # GSPO: "sequence"

    def prepare(self, rewards, mask, inputs, old_logprobs, ref_logprobs, turn_rewards=None) -> dict[str, torch.Tensor]:
        return {"advantages": self.advantages(rewards, mask, old_logprobs, ref_logprobs)}

    def advantages(self, rewards, mask, old_logprobs, ref_logprobs) -> torch.Tensor:
        """Per-token advantages (B, T): the sequence's outcome advantage on each completion token."""
        return group_advantages(rewards, self.config.group_size, scale_std=self.config.scale_rewards)[:, None] * mask

    def loss(self, out: TokenOutputs, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped surrogate (and β·KL); without ``old_logprobs`` in ``mb`` the old policy is the one being
        trained (one update per rollout: the ratio is exactly 1)."""
        c = self.config
        assert out.logprobs is not None
        old, is_weights = mb.get("old_logprobs"), mb.get("is_weights")
        if old is None:
            old = out.logprobs.detach()
            if "engine_logprobs" in mb:  # off-policy weights around the update's own (proximal) log-probs
                live = mb["weights"] != 0
                is_weights = off_policy_weights(old, mb["engine_logprobs"], live, mb.get("stale"), c.tis_cap, c.mis_cap)
        loss, stats = self.token_loss(out.logprobs, old, mb, is_weights)
        if out.entropy is not None:
            stats["entropy"] = (mb["weights"] * out.entropy).sum()
        return loss, stats

    def token_loss(
        self, logp: torch.Tensor, old: torch.Tensor, mb: Batch, is_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped surrogate of the micro-batch's tokens (ratio per token, or per sequence) and β·KL."""
        c = self.config
        return grpo_loss(
            logp,
            old,
            mb["advantages"],
            mb["weights"],
            ref_logp=mb.get("ref_logprobs"),
            beta=c.beta if self.kl_in_loss else 0.0,
            eps_low=c.eps_low,
            eps_high=c.eps_high,
            kl_estimator=c.kl_estimator,
            is_weights=is_weights,
            level=self.ratio_level,
        )


class GRPO(GroupPolicyGradient):
    name = "grpo"
    summary = "GRPO (group-relative advantages; Dr. GRPO, clip-higher, dynamic sampling as options) on engine rollouts"
    options = OPTIONS["grpo"]


class RLOO(GroupPolicyGradient):
    name = "rloo"
    summary = "RLOO (leave-one-out baseline) on engine rollouts"
    options = OPTIONS["rloo"]

    def advantages(self, rewards, mask, old_logprobs, ref_logprobs) -> torch.Tensor:
        return rloo_advantages(rewards, self.config.group_size)[:, None] * mask


class ReinforcePP(GroupPolicyGradient):
    name = "reinforce-pp"
    summary = "REINFORCE++ (KL in the reward, batch-whitened returns) on engine rollouts"
    options = OPTIONS["reinforce-pp"]
    kl_in_loss = False

    @property
    def reuses_update_logprobs(self) -> bool:
        return self.config.beta == 0  # a KL in the reward needs the old log-probs before the update

    def advantages(self, rewards, mask, old_logprobs, ref_logprobs) -> torch.Tensor:
        beta = self.config.beta
        if beta > 0:
            assert old_logprobs is not None and ref_logprobs is not None
            kl = old_logprobs - ref_logprobs
        else:
            kl = torch.zeros_like(mask)
        return reinforce_pp_advantages(rewards, kl * mask, mask, beta)
