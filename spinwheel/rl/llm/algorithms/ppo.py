"""PPO for LLMs (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"; Ouyang et al. 2022):
a learned critic, per-token rewards ``−β·KL_t`` with each turn's reward at the turn's last sampled token (a
single-turn completion: the score at its final token), token-level GAE (γ, λ) over the sampled tokens only
(a multi-turn episode's observation tokens are not steps: the recursion jumps over them), whitened advantages, the
clipped surrogate and the clipped value loss, with a fixed or adaptive β controller.

The critic is a separate scalar-head model initialised from the policy's body
(:func:`~spinwheel.models.transformer.scalar_head_model`), trained by its own learner on the same layout; its value
at position t is V(s_t), the state before label t (the alignment :func:`~spinwheel.rl.llm.token_advantages.token_gae`
expects). The math is in :mod:`spinwheel.rl.llm.token_advantages` and :mod:`spinwheel.rl.llm.token_losses`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from spinwheel.models.hf import load_model
from spinwheel.models.transformer import scalar_head_model
from spinwheel.parallel.token_outputs import TokenOutputs
from spinwheel.parallel.trainer import Batch
from spinwheel.rl.llm.algorithm_options import OPTIONS
from spinwheel.rl.llm.algorithms.base import Algorithm, Parts
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.token_advantages import AdaptiveKLController, FixedKLController, token_gae, token_rewards, whiten
from spinwheel.rl.llm.token_losses import clipped_policy_loss, clipped_value_loss, token_weights
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.learners import OptimConfig


class PPO(Algorithm):
    """PPO with a critic learner (see the module docstring)."""

    name = "ppo"
    summary = "PPO for LLMs (critic, token-level GAE, KL penalty to the reference) on engine rollouts"
    options = OPTIONS["ppo"]

    def __init__(self, config: RLConfig, parts: Parts) -> None:
        super().__init__(config, parts)
        self.kl = (
            AdaptiveKLController(config.beta, config.kl_target, config.kl_horizon)
            if config.kl_target
            else FixedKLController(config.beta)
        )
        critic_dir = parts.out_dir / "critic"
        resuming = parts.resume_step is not None
        if resuming:
            model = load_model(critic_dir, dtype=config.dtype, device=config.device, lazy=parts.lazy)
        else:
            model = scalar_head_model(parts.initial_policy(), seed=config.seed)
        self.critic = parts.make_learner(model, OptimConfig(config.critic_lr, 0.0, config.grad_clip))
        if resuming:
            state = load_trainer_state(critic_dir)
            if state is None or state["step"] != parts.resume_step:
                raise ValueError(
                    f"{critic_dir} does not match the policy checkpoint at step {parts.resume_step} (the run "
                    "stopped between the two saves); rerun with --no-resume to start over"
                )
            self.critic.load(critic_dir, state)
            self.kl.load_state_dict(state["kl_coef"])

    @property
    def reuses_update_logprobs(self) -> bool:
        return False  # the KL reward needs the old log-probs before the update

    def prepare(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        inputs: Batch,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        turn_rewards: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-row tensors for the update: whitened GAE advantages, value targets and the rollout-time values."""
        c = self.config
        values = self.critic.forward(inputs)["values"] * mask
        kl = (old_logprobs - ref_logprobs) * mask if ref_logprobs is not None else torch.zeros_like(mask)
        scores = rewards if turn_rewards is None else turn_rewards  # per turn, at each turn's last token
        token_r = token_rewards(scores.to(mask.dtype), kl, mask, self.kl.value)
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

    def minibatch_done(self, mb: Batch, mask: torch.Tensor, lr_scale: float) -> dict[str, float]:
        """One critic update on the policy's minibatch (token-mean weights, the critic's own learning rate)."""
        batch = {k: mb[k] for k in ("input_ids", "labels", "returns", "old_values")}
        batch["weights"] = token_weights(mask, "token-mean")
        out = self.critic.train_step(batch, self.value_loss, self.config.critic_lr * lr_scale)
        return {**out.stats, "critic_grad_norm": out.grad_norm or 0.0, "kl_coef": self.kl.value}

    def save(self, out_dir: Path, state: dict[str, Any]) -> None:
        self.critic.save(out_dir / "critic", None, {"step": state["step"], "kl_coef": self.kl.state_dict()})
