"""The GRPO family on the shared rollout loop: what each algorithm makes of a scored rollout batch (advantages,
and whether it needs a frozen reference) and the per-token loss it hands to the trainer.

* **GRPO** (Shao et al. 2024, DeepSeekMath): group-normalised outcome advantages ``(r − mean_g) / std_g``, the
  clipped surrogate per token and ``β·KL(π‖π_ref)`` in the loss. Dr. GRPO (Liu et al. 2025) is
  ``--no-scale-rewards --loss-agg seq-mean-token-sum-norm``; DAPO's clip-higher is ``--eps-high > --eps-low``,
  its dynamic sampling ``--dynamic-sampling``.
* **RLOO** (Ahmadian et al. 2024): the leave-one-out baseline ``r_i − mean_{j≠i} r_j``, same loss.
* **REINFORCE++** (Hu et al. 2025): per-token returns with the KL to the reference *in the reward* (k1), whitened
  over the whole batch; the loss is the clipped surrogate without a KL term.

The math is in :mod:`spinwheel.rl.llm_advantages` and :mod:`spinwheel.rl.token_losses` (tested against the
published formulas); this module only wires it.
"""

from __future__ import annotations

import torch

from spinwheel.parallel.token_outputs import TokenOutputs
from spinwheel.parallel.trainer import Batch
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm_advantages import group_advantages, reinforce_pp_advantages, rloo_advantages
from spinwheel.rl.token_losses import grpo_loss, truncated_is_weights


class GroupPolicyGradient:
    """GRPO, RLOO or REINFORCE++ (``config.algo``); see the module docstring."""

    def __init__(self, config: RLConfig) -> None:
        self.config = config
        self.kl_in_loss = config.algo in ("grpo", "rloo") and config.beta > 0
        self.kl_in_reward = config.algo == "reinforce-pp" and config.beta > 0

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def prepare(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        inputs: Batch,
        old_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """Per-row tensors the update reads: here only the advantages."""
        return {"advantages": self.advantages(rewards, mask, old_logprobs, ref_logprobs)}

    def advantages(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Per-token advantages (B, T) from rewards (B,) of the rollout batch (rows prompt-major, groups of G);
        ``old_logprobs`` (B, T) are needed only for REINFORCE++'s KL in the reward."""
        c, g = self.config, self.config.group_size
        if c.algo in ("grpo", "trpo"):
            adv = group_advantages(rewards, g, scale_std=c.scale_rewards)
        elif c.algo == "rloo":
            adv = rloo_advantages(rewards, g)
        else:
            if self.kl_in_reward:
                assert old_logprobs is not None and ref_logprobs is not None
                kl = old_logprobs - ref_logprobs
            else:
                kl = torch.zeros_like(mask)
            return reinforce_pp_advantages(rewards, kl * mask, mask, c.beta if self.kl_in_reward else 0.0)
        return adv[:, None] * mask

    def loss(self, out: TokenOutputs, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's contribution to the global loss (weights were computed on the whole minibatch).
        Without ``old_logprobs`` in ``mb`` the old policy is the one being trained (one update per rollout)."""
        c = self.config
        assert out.logprobs is not None
        old, is_weights = mb.get("old_logprobs"), mb.get("is_weights")
        if old is None:  # one update per rollout: the old policy is the current one (the ratio is exactly 1)
            old = out.logprobs.detach()
            if c.tis_cap is not None:
                is_weights = truncated_is_weights(old, mb["engine_logprobs"], c.tis_cap)
        loss, stats = grpo_loss(
            out.logprobs,
            old,
            mb["advantages"],
            mb["weights"],
            ref_logp=mb.get("ref_logprobs"),
            beta=c.beta if self.kl_in_loss else 0.0,
            eps_low=c.eps_low,
            eps_high=c.eps_high,
            kl_estimator=c.kl_estimator,
            is_weights=is_weights,
        )
        if out.entropy is not None:
            stats["entropy"] = (mb["weights"] * out.entropy).sum()
        return loss, stats
