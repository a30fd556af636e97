"""CISPO (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, §3.1): GRPO's group advantages with the clipped importance
weight, stop-gradient, multiplying ``A · log π`` (:func:`~spinwheel.rl.llm.off_policy.cispo_loss`) instead of PPO's
clipped surrogate, so tokens whose ratio leaves the clip range still carry their gradient. The paper imposes no
lower bound on the weight (``--eps-low 1``: clip at 0) and tunes the upper one."""

from __future__ import annotations

import torch

from spinwheel.parallel.trainer import Batch
from spinwheel.rl.llm.algorithm_options import OPTIONS
from spinwheel.rl.llm.algorithms.grpo import GroupPolicyGradient
from spinwheel.rl.llm.off_policy import cispo_loss
from spinwheel.rl.llm.token_losses import _with_kl_penalty


class CISPO(GroupPolicyGradient):
    name = "cispo"
    summary = (
        "CISPO (clipped stop-gradient importance weights on a REINFORCE term, group advantages) on engine rollouts"
    )
    options = OPTIONS["cispo"]
    defaults = {"eps_low": 1.0}

    def token_loss(
        self, logp: torch.Tensor, old: torch.Tensor, mb: Batch, is_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        loss, stats = cispo_loss(logp, old, mb["advantages"], mb["weights"], c.eps_low, c.eps_high, is_weights)
        return _with_kl_penalty(loss, stats, logp, mb.get("ref_logprobs"), mb["weights"], c.beta, c.kl_estimator)
