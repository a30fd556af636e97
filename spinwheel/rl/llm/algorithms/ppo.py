"""PPO for LLMs (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"; Ouyang et al. 2022):
a learned critic, per-token rewards ``−β·KL_t`` with the sequence score at the final token, token-level GAE (γ, λ),
whitened advantages, the clipped surrogate and the clipped value loss, with a fixed or adaptive β controller.

The critic is a separate scalar-head model initialised from the policy's body
(:func:`~spinwheel.models.transformer.scalar_head_model`), trained by its own learner on the same layout; its value
at position t is V(s_t), the state before label t (the alignment :func:`~spinwheel.rl.llm_advantages.token_gae`
expects). The math is in :mod:`spinwheel.rl.llm_advantages` and :mod:`spinwheel.rl.token_losses`.
"""

from __future__ import annotations

import torch

from spinwheel.parallel.token_outputs import TokenOutputs
from spinwheel.parallel.trainer import Batch
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm_advantages import AdaptiveKLController, FixedKLController, token_gae, token_rewards, whiten
from spinwheel.rl.token_losses import clipped_policy_loss, clipped_value_loss, token_weights
from spinwheel.train.learners import Learner


class PPO:
    """PPO with a critic learner (see the module docstring)."""

    def __init__(self, config: RLConfig, critic: Learner) -> None:
        self.config, self.critic = config, critic
        self.kl = (
            AdaptiveKLController(config.beta, config.kl_target, config.kl_horizon)
            if config.kl_target
            else FixedKLController(config.beta)
        )

    @property
    def needs_reference(self) -> bool:
        return self.config.beta > 0

    def prepare(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        inputs: Batch,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """Per-row tensors for the update: whitened GAE advantages, value targets and the rollout-time values."""
        c = self.config
        values = self.critic.forward(inputs)["values"] * mask
        kl = (old_logprobs - ref_logprobs) * mask if ref_logprobs is not None else torch.zeros_like(mask)
        token_r = token_rewards(rewards.to(mask.dtype), kl, mask, self.kl.value)
        advantages, returns = token_gae(token_r, values, mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = whiten(advantages, mask)
        self.last_kl = float((kl.sum(1)).mean())  # per sequence, what the adaptive controller targets
        self.kl.update(self.last_kl, rewards.shape[0])
        return {"advantages": advantages, "returns": returns, "old_values": values}

    def loss(self, out: TokenOutputs, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert out.logprobs is not None
        c = self.config
        loss, stats = clipped_policy_loss(
            out.logprobs,
            mb["old_logprobs"],
            mb["advantages"],
            mb["weights"],
            c.eps_low,
            c.eps_high,
            mb.get("is_weights"),
        )
        if out.entropy is not None:
            stats["entropy"] = (mb["weights"] * out.entropy).sum()
        return loss, stats

    def value_loss(self, out: TokenOutputs, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert out.values is not None
        return clipped_value_loss(out.values, mb["old_values"], mb["returns"], mb["weights"], self.config.value_clip)

    def critic_step(self, mb: Batch, mask: torch.Tensor, lr_scale: float) -> dict[str, float]:
        """One critic update on the policy's minibatch (token-mean weights, the critic's own learning rate)."""
        batch = {k: mb[k] for k in ("input_ids", "labels", "returns", "old_values")}
        batch["weights"] = token_weights(mask, "token-mean")
        out = self.critic.train_step(batch, self.value_loss, self.config.critic_lr * lr_scale)
        return {**out.stats, "critic_grad_norm": out.grad_norm or 0.0, "kl_coef": self.kl.value}
