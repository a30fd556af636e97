"""TRPO for LLM policies (Schulman et al. 2015), on the token level: the natural-gradient direction by conjugate
gradient on Fisher-vector products of the mean per-token KL, scaled to the trust-region radius δ, then a
backtracking line search that keeps ``KL(π_old ‖ π_new) ≤ δ`` and an improved surrogate (else no step).

* surrogate ``L(θ) = Σ w · exp(log π_θ − log π_old) · A`` over completion tokens (weights ``w`` from the whole
  batch), advantages from the group baseline (as GRPO's);
* ``KL(θ) = Σ w · Σ_v π_old(v) (log π_old(v) − log π_θ(v))`` — the exact KL of each token's categorical
  distribution over the whole vocabulary (its Hessian at θ_old is the Fisher matrix), not a sampled estimate;
* data parallel (DDP): each rank evaluates its rows with the global weights and :mod:`spinwheel.rl.trpo`'s
  ``reduce`` sums gradients, Fisher-vector products and line-search values over the data-parallel ranks, so every
  rank takes the same step. Layouts that shard or split parameters (ZeRO, FSDP, TP, PP) are refused.

The solver (conjugate gradient, Fisher-vector products by double back-propagation, line search) is
:func:`spinwheel.rl.trpo.trust_region_step`, shared with classic-control TRPO.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from spinwheel.engine.llm_engine import flush_denormal
from spinwheel.parallel.mesh import ParallelError
from spinwheel.rl.llm.algorithms import GroupPolicyGradient
from spinwheel.rl.trpo import trust_region_step
from spinwheel.train.learners import Learner, LocalLearner, ParallelLearner


def trpo_module(learner: Learner) -> tuple[nn.Module, object | None]:
    """The plain model TRPO steps in place, and the data-parallel reduce (None in one process)."""
    if isinstance(learner, LocalLearner):
        return learner.model, None
    assert isinstance(learner, ParallelLearner)
    pm = learner.trainer.pm
    if pm.dp_kind != "ddp" or learner.dims.tp > 1 or learner.dims.pp > 1:
        raise ParallelError(
            "trpo runs in one process or data parallel with DDP (--zero 0): its conjugate gradient "
            "needs every parameter whole on each rank; drop --zero/--fsdp/--tp/--pp"
        )
    axis, comm = learner.dims.dp_axis, learner.dims.comm

    def reduce(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        comm.all_reduce(x, axis)
        return x

    return pm.stage, reduce


def trpo_update(
    learner: Learner,
    batch: dict[str, torch.Tensor],
    max_kl: float,
    damping: float,
    cg_iters: int,
    backtrack_coef: float = 0.8,
    max_backtracks: int = 10,
) -> dict[str, float]:
    """One trust-region step on the global ``batch`` (``input_ids``, ``labels``, ``weights``, ``advantages``,
    ``old_logprobs``; rows this rank owns are its data-parallel slice)."""
    model, reduce = trpo_module(learner)
    if reduce is not None:
        dp = learner.dims.dp_axis  # type: ignore[attr-defined]
        b = batch["input_ids"].shape[0]
        rows = slice(dp.rank * (b // dp.size), (dp.rank + 1) * (b // dp.size))
        batch = {k: v[rows] for k, v in batch.items()}
    ids, labels, w, adv = batch["input_ids"], batch["labels"], batch["weights"], batch["advantages"]
    with torch.no_grad():
        old_full = F.log_softmax(model(ids).float(), dim=-1)  # (b, T, V): π_old over the whole vocabulary
    old_picked = batch["old_logprobs"]

    def current() -> torch.Tensor:
        return F.log_softmax(model(ids).float(), dim=-1)

    def surrogate_fn() -> torch.Tensor:
        logp = current().gather(-1, labels[..., None])[..., 0]
        return (w * (logp - old_picked).exp() * adv).sum()

    def kl_fn() -> torch.Tensor:
        kl_tok = (old_full.exp() * (old_full - current())).sum(-1)  # (b, T)
        return (w * kl_tok).sum()

    params = [p for p in model.parameters() if p.requires_grad]
    seen: set[int] = set()
    params = [p for p in params if not (id(p) in seen or seen.add(id(p)))]  # tied weights once
    # Fisher-vector products differentiate twice; PyTorch's fused CPU/GPU attention kernels have no double
    # backward, the math kernel does (same values). π_old(v) · … over the whole vocabulary is full of denormals
    # (probabilities of e^-90 and below), which slow CPU kernels about 2× on this model: flush them.
    with sdpa_kernel(SDPBackend.MATH), flush_denormal(ids.device.type == "cpu"):
        return trust_region_step(
            params,
            surrogate_fn,
            kl_fn,
            max_kl,
            damping=damping,
            cg_iters=cg_iters,
            backtrack_coef=backtrack_coef,
            max_backtracks=max_backtracks,
            reduce=reduce,
        )


class TRPO(GroupPolicyGradient):
    """Group-baseline advantages (GRPO's) with a trust-region step instead of clipped minibatch updates."""

    def update(self, learner: Learner, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        c = self.config
        return trpo_update(learner, batch, c.max_kl, c.cg_damping, c.cg_iters)
