"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071): GRPO's group advantages with
the importance ratio, and its clipping, on whole sequences — ``s_i = (π(y_i|x) / π_old(y_i|x))^(1/|y_i|)`` — so
each sequence's tokens share one weight. The surrogate is
:func:`~spinwheel.rl.llm.token_losses.sequence_clipped_policy_loss`; the
paper's clip range is far narrower than GRPO's (it clips a length-normalised sequence ratio), so the command's
defaults are ``--eps-low 3e-4 --eps-high 4e-4``.
"""

from __future__ import annotations

from spinwheel.rl.llm.algorithm_options import OPTIONS
from spinwheel.rl.llm.algorithms.grpo import GroupPolicyGradient


class GSPO(GroupPolicyGradient):
    name = "gspo"
    summary = "GSPO (sequence-level importance ratio and clipping, group advantages) on engine rollouts"
    options = OPTIONS["gspo"]
    defaults = {"eps_low": 3e-4, "eps_high": 4e-4}
    loss_agg = "seq-mean-token-mean"  # a row's weight is 1/G, its tokens average the sequence's log-ratio
    ratio_level = "sequence"
