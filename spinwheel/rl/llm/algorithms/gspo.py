"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): GRPO's group advantages with
the importance ratio, and its clipping, on whole sequences — ``s_i = (π(y_i|x) / π_old(y_i|x))^(1/|y_i|)`` — so
each sequence's tokens share one weight. The loss is :func:`~spinwheel.rl.llm.token_losses.gspo_loss`; the
paper's clip range is far narrower than GRPO's (it clips a length-normalised sequence ratio), so the command's
defaults are ``--eps-low 3e-4 --eps-high 4e-4``.
"""

from __future__ import annotations

import torch

from spinwheel.parallel.trainer import Batch
from spinwheel.rl.llm.algorithms.grpo import GroupPolicyGradient
from spinwheel.rl.llm.token_losses import gspo_loss


class GSPO(GroupPolicyGradient):
    name = "gspo"
    summary = "GSPO (sequence-level importance ratio and clipping, group advantages) on engine rollouts"
    options = frozenset({"beta", "kl_estimator", "eps_low", "eps_high", "scale_rewards", "epochs", "minibatches"})
    defaults = {"eps_low": 3e-4, "eps_high": 4e-4}
    loss_agg = "seq-mean-token-mean"  # a row's weight is 1/G, its tokens average the sequence's log-ratio

    def token_loss(
        self, logp: torch.Tensor, old: torch.Tensor, mb: Batch, is_weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        kl = dict(ref_logp=mb.get("ref_logprobs"), beta=c.beta, kl_estimator=c.kl_estimator)
        return gspo_loss(logp, old, mb["advantages"], mb["weights"], eps_low=c.eps_low, eps_high=c.eps_high, **kl)
