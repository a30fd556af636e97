"""What an LLM RL algorithm is to the loop: it owns its state and parts and declares what it needs; the loop
(:mod:`spinwheel.rl.llm.loop`) calls this interface and never names an algorithm.

An algorithm

* declares the options that act for it (``options``: fields of :class:`~spinwheel.rl.llm.config.RLConfig` beyond
  the shared ones, from the table in :mod:`~spinwheel.rl.llm.algorithm_options`; the others are refused for its
  command) and where its command's defaults differ (``defaults``);
* says whether it needs a frozen reference (``needs_reference``) and whether the update's own forward may stand in
  for the old policy's log-probs (``reuses_update_logprobs``; one update per rollout in one process);
* turns a scored rollout batch into the per-row tensors its update reads (:meth:`prepare`: advantages, ...);
* gives the per-token loss (:meth:`loss`) and runs the update (:meth:`update`: by default ``epochs`` passes of
  ``minibatches`` optimizer steps; TRPO replaces it with its trust-region step);
* saves and restores what it keeps beside the policy (:meth:`save` / :meth:`load`: PPO's critic).

Adding one is a file with a subclass, a line in the registry (:mod:`spinwheel.rl.llm.algorithms`) and its row of
options (:mod:`~spinwheel.rl.llm.algorithm_options`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from spinwheel.parallel.token_outputs import TokenOutputs
from spinwheel.parallel.trainer import Batch
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.token_losses import token_weights
from spinwheel.train.learners import Learner, OptimConfig, minibatch_updates
from spinwheel.train.optim import lr_at


@dataclasses.dataclass
class Parts:
    """What an algorithm may build its parts from: a fresh copy of the initial policy, a learner on the policy's
    layout, and (resuming) the run's directory and step."""

    initial_policy: Callable[[], Any]
    make_learner: Callable[[Any, OptimConfig | None], Learner]
    out_dir: Path
    resume_step: int | None  # None: a new run
    lazy: bool = False  # under torchrun: checkpoints are read as the learner shards them (parallel/io/lazy_load.py)


class Algorithm:
    """The interface (see the module docstring); subclasses override what differs."""

    name: ClassVar[str]
    summary: ClassVar[str]  # the command's one-line help
    options: ClassVar[frozenset[str]] = frozenset()
    defaults: ClassVar[dict[str, Any]] = {}
    loss_agg: str | None = None  # None: the run's --loss-agg

    def __init__(self, config: RLConfig, parts: Parts) -> None:
        self.config = config

    @property
    def needs_reference(self) -> bool:
        return "beta" in self.options and self.config.beta > 0

    @property
    def reuses_update_logprobs(self) -> bool:
        """Whether, with one update per rollout, the update's own forward may give the old policy's log-probs
        (False where they are needed before the update)."""
        return True

    def prepare(
        self,
        rewards: torch.Tensor,
        mask: torch.Tensor,
        inputs: Batch,
        old_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        turn_rewards: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-row tensors (B, T) the update reads, from rewards (B,) of the rollout batch (rows prompt-major,
        groups of G), its completion ``mask`` (B, T), the old / reference log-probs (None where not computed) and
        ``turn_rewards`` (B, T): each turn's reward at its last sampled token (PPO's per-turn rewards)."""
        raise NotImplementedError

    def loss(self, out: TokenOutputs, mb: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A micro-batch's contribution to the global loss (``mb["weights"]`` were computed on the minibatch)."""
        raise NotImplementedError

    def _kept_loss(self, own: list[torch.Tensor], out: TokenOutputs, mb: Batch) -> tuple[torch.Tensor, dict]:
        if out.logprobs is not None:
            own.append(out.logprobs.detach())
        return self.loss(out, mb)

    def minibatch_done(self, mb: Batch, mask: torch.Tensor, lr_scale: float) -> dict[str, float]:
        """Called after each policy optimizer step (PPO steps its critic here); returns figures to average."""
        return {}

    def update(
        self, learner: Learner, per_row: dict[str, torch.Tensor], step: int, own: list[torch.Tensor] | None = None
    ) -> dict[str, float]:
        """``epochs`` passes of ``minibatches`` optimizer steps over the rollout batch (the learner's
        :func:`~spinwheel.train.learners.minibatch_updates`) on the run's learning-rate schedule; the mean figures.
        ``own``: a list that takes the update's own log-probs (detached), where they stand in for the old policy's."""
        c = self.config
        total = c.steps * c.updates_per_step
        return minibatch_updates(
            learner,
            per_row,
            self.loss if own is None else functools.partial(self._kept_loss, own),
            epochs=c.epochs,
            minibatches=c.minibatches,
            seed=(c.seed * 1_000_003 + step) * 97,
            weights=lambda mask: token_weights(mask, self.loss_agg or c.loss_agg, max_len=c.max_new_tokens),
            lr=lambda n: lr_at(step * c.updates_per_step + n, c.lr, c.warmup_steps, total, c.min_lr_ratio),
            after=lambda mb, mask, lr: self.minibatch_done(mb, mask, lr / c.lr),
        )

    def save(self, out_dir: Path, state: dict[str, Any]) -> None:
        """Write what the algorithm keeps beside the policy (before the policy's checkpoint: a checkpoint never
        points at a missing part)."""
