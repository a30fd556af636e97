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

The solver (conjugate gradient, line search) is :func:`spinwheel.rl.trpo.trust_region_step`, shared with
classic-control TRPO; the Fisher-vector products are :func:`logit_fisher_product` (Gauss–Newton: forward-mode
``J v``, then ``Jᵀ M J v`` by one backward), equal to the double back-propagation through the KL that classic
control uses; the whole step measured 1.1–1.3× faster with them on the demo model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from spinwheel.engine.llm_engine import flush_denormal
from spinwheel.parallel.mesh import ParallelError
from spinwheel.rl.llm.algorithm_options import OPTIONS
from spinwheel.rl.llm.algorithms.grpo import GroupPolicyGradient
from spinwheel.rl.llm.token_losses import token_weights
from spinwheel.rl.trpo import flat_grad, trust_region_step
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
    fisher_fraction: float = 1.0,
) -> dict[str, float]:
    """One trust-region step on the global ``batch`` (``input_ids``, ``labels``, ``weights``, ``advantages``,
    ``old_logprobs``; rows this rank owns are its data-parallel slice).

    ``fisher_fraction`` < 1 runs the conjugate gradient's Fisher-vector products on an evenly strided subset of
    the rows (:func:`fisher_rows`; OpenAI baselines' TRPO uses a fifth), so a large batch's gradient costs its full
    forward and backward but each of the ``cg_iters`` products only a fraction; the gradient, the surrogate and the
    line search's KL check stay on every row, so the step still keeps the whole batch's KL ≤ ``max_kl``. The rows are
    chosen on the global batch, so data-parallel ranks take the step one process takes."""
    model, reduce = trpo_module(learner)
    # the Fisher rows are picked on the global batch (and their weights scaled to its sum), so every layout
    # computes the same products: each rank keeps the picked rows of its own slice
    sub, fisher_scale = fisher_rows(batch["weights"], fisher_fraction)
    if reduce is not None:
        dp = learner.dims.dp_axis  # type: ignore[attr-defined]
        b = batch["input_ids"].shape[0]
        lo, hi = dp.rank * (b // dp.size), (dp.rank + 1) * (b // dp.size)
        batch = {k: v[lo:hi] for k, v in batch.items()}
        if sub is not None:
            sub = sub[(sub >= lo) & (sub < hi)] - lo
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

    # π_old(v) · … over the whole vocabulary is full of denormals (probabilities of e^-90 and below), which slow
    # CPU kernels about 2× here: flush them.
    with flush_denormal(ids.device.type == "cpu"):
        params, fvp = (
            logit_fisher_product(model, ids, w, old_full, damping, reduce)
            if sub is None
            else logit_fisher_product(model, ids[sub], w[sub] * fisher_scale, old_full[sub], damping, reduce)
        )
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
            fvp=fvp,
        )


def fisher_rows(weights: torch.Tensor, fraction: float) -> tuple[torch.Tensor | None, float]:
    """Indices of every ``round(1 / fraction)``-th row of ``weights`` (b, T) that has weight (None: all rows), and
    the factor that scales the subset's weights to the whole batch's sum, so the subsampled Fisher estimates the
    same matrix. Strided over the batch so the subset covers every prompt group evenly."""
    if fraction >= 1.0:
        return None, 1.0
    live = torch.nonzero(weights.sum(-1) > 0)[:, 0]
    stride = max(1, round(1.0 / fraction))
    if stride == 1 or live.numel() <= stride:
        return None, 1.0
    rows = live[::stride]
    return rows, float(weights.sum() / weights[rows].sum())


def logit_fisher_product(
    model: nn.Module,
    ids: torch.Tensor,
    weights: torch.Tensor,
    old_logp: torch.Tensor,
    damping: float,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[nn.Parameter], Callable[[torch.Tensor], torch.Tensor]]:
    """The trainable parameters (tied weights once) and ``v ↦ (F + damping·I) v``, in Gauss–Newton form.

    ``F = Jᵀ M J``: ``J = ∂z/∂θ`` the Jacobian of the logits ``z`` (b, T, V) and ``M`` per token
    ``w · (diag(p) − p pᵀ)``, the Hessian of ``w · KL(p ‖ softmax(z))`` in ``z`` at ``p = π_old`` (``weights`` (b, T),
    ``old_logp`` (b, T, V)). This *is* the Hessian of the weighted KL at θ_old — its other term, ``∂KL/∂z ·
    ∂²z/∂θ²``, vanishes there because ``∂KL/∂z = softmax(z) − p = 0`` — computed as one forward-mode pass for
    ``J v`` and one backward through a logits graph built once for ``Jᵀ (M J v)``, instead of back-propagating
    twice through the KL. Data parallel: ``reduce`` sums the products over ranks.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # named_parameters dedups ties
    names, params = [n for n, _ in named], [p for _, p in named]
    primals = tuple(p.detach() for p in params)
    probs = old_logp.exp()
    logits = model(ids).float()  # the graph each Jᵀ u goes back through

    def logits_at(*values: torch.Tensor) -> torch.Tensor:
        return functional_call(model, dict(zip(names, values)), (ids,)).float()

    def fvp(v: torch.Tensor) -> torch.Tensor:
        tangents = tuple(t.view_as(p) for t, p in zip(v.split([p.numel() for p in params]), params))
        with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no forward-AD formula
            _, jv = jvp(logits_at, primals, tangents)
        u = weights[..., None] * probs * (jv - (probs * jv).sum(-1, keepdim=True))
        flat = flat_grad(logits, params, retain_graph=True, grad_outputs=u)
        return (flat if reduce is None else reduce(flat)) + damping * v

    return params, fvp


class TRPO(GroupPolicyGradient):
    """Group-baseline advantages (GRPO's) with a trust-region step instead of clipped minibatch updates."""

    name = "trpo"
    summary = "TRPO for LLM policies (conjugate gradient on Fisher-vector products, KL trust region) on engine rollouts"
    options = OPTIONS["trpo"]

    @property
    def reuses_update_logprobs(self) -> bool:
        return False  # the surrogate's ratio needs the old policy before the step

    def update(self, learner: Learner, per_row: dict[str, torch.Tensor], step: int, own=None) -> dict[str, float]:
        c = self.config
        batch = {k: v for k, v in per_row.items() if k != "mask"}
        batch["weights"] = token_weights(per_row["mask"], c.loss_agg, max_len=c.max_new_tokens)
        return trpo_update(learner, batch, c.max_kl, c.cg_damping, c.cg_iters, fisher_fraction=c.fisher_fraction)
