"""Trust-region policy steps: conjugate gradient, Fisher-vector products, KL-radius scaling, line search.

References: Schulman et al., "Trust Region Policy Optimization" (2015), appendix C; Kakade, "A Natural Policy
Gradient" (2001); Nocedal & Wright, "Numerical Optimization", algorithm 5.2 (conjugate gradient).

Generic over any ``nn.Module`` (a classic-control actor or an LLM): the caller hands in its parameters and
closures that recompute the scalar objectives from the *current* parameter values:

================= ==================================================================================
``surrogate_fn``  the surrogate advantage ``L(θ) = mean(π_θ(a|s) / π_old(a|s) · A)`` to maximise
``kl_fn``         the mean ``KL(π_old ‖ π_θ)`` over the batch's states (0 with zero gradient at θ_old)
================= ==================================================================================

Data parallel: pass ``reduce`` (a sum over ranks) and let each rank's closures return its share of the
global mean (the local mean scaled by ``n_local / n_total``); gradients, Fisher-vector products and the
line search's objective values are then summed, so every rank takes the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

Reduce = Callable[[Tensor], Tensor]


def _identity(x: Tensor) -> Tensor:
    return x


def flat_grad(
    output: Tensor,
    params: Sequence[nn.Parameter],
    create_graph: bool = False,
    retain_graph: bool | None = None,
    grad_outputs: Tensor | None = None,
) -> Tensor:
    """Gradient of scalar ``output`` (or the vector-Jacobian product ``grad_outputsᵀ ∂output/∂θ`` of a tensor
    ``output``) w.r.t. ``params``, flattened into one vector (zeros for unused); the graph is kept when
    ``retain_graph`` (default: ``create_graph``)."""
    retain = create_graph if retain_graph is None else retain_graph
    grads = torch.autograd.grad(
        output, list(params), grad_outputs, create_graph=create_graph, retain_graph=retain, allow_unused=True
    )
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor], b: Tensor, max_iters: int = 10, residual_tol: float = 1e-10
) -> tuple[Tensor, dict[str, float]]:
    """Solve ``A x = b`` for symmetric positive-definite ``A`` given only ``matvec(v) = A v``.

    Starts from ``x = 0``; stops after ``max_iters`` matrix-vector products or when ``‖r‖² < residual_tol``.
    Returns ``(x, {"cg_iters", "cg_residual"})`` with the final squared residual norm.
    """
    x = torch.zeros_like(b)
    r = b.clone()  # residual b - A x
    p = b.clone()  # search direction
    rr = torch.dot(r, r)
    iters = 0
    while iters < max_iters and rr.item() >= residual_tol:
        Ap = matvec(p)
        alpha = rr / torch.dot(p, Ap)
        x += alpha * p
        r -= alpha * Ap
        rr_new = torch.dot(r, r)
        p = r + (rr_new / rr) * p
        rr = rr_new
        iters += 1
    return x, {"cg_iters": float(iters), "cg_residual": rr.item()}


def fisher_vector_product(
    kl_fn: Callable[[], Tensor],
    params: Sequence[nn.Parameter],
    damping: float = 0.1,
    reduce: Reduce | None = None,
) -> Callable[[Tensor], Tensor]:
    """Return ``v ↦ (H + damping·I) v`` with ``H`` the Hessian of the mean KL at the current parameters.

    At ``θ = θ_old`` the Hessian of ``KL(π_old ‖ π_θ)`` is the Fisher information matrix. Computed by double
    back-propagation (Pearlmutter's trick): ``H v = ∇(∇KL · v)``; the KL graph is built once and reused.
    """
    reduce = reduce or _identity
    grad_kl = flat_grad(kl_fn(), params, create_graph=True)

    def fvp(v: Tensor) -> Tensor:
        return reduce(flat_grad(torch.dot(grad_kl, v), params, retain_graph=True)) + damping * v

    return fvp


def kl_radius_scale(direction: Tensor, fisher_direction: Tensor, max_kl: float) -> Tensor:
    """Step length ``β = sqrt(2δ / (xᵀ H x))`` so that the quadratic KL model ``½ (βx)ᵀ H (βx)`` equals δ."""
    shs = torch.dot(direction, fisher_direction).clamp(min=1e-12)
    return torch.sqrt(2.0 * max_kl / shs)


def backtracking_line_search(
    params: Sequence[nn.Parameter],
    full_step: Tensor,
    surrogate_fn: Callable[[], Tensor],
    kl_fn: Callable[[], Tensor],
    max_kl: float,
    backtrack_coef: float = 0.8,
    max_backtracks: int = 10,
    reduce: Reduce | None = None,
) -> tuple[bool, dict[str, float]]:
    """Try ``θ_old + coef^k · full_step`` for ``k = 0, 1, …``; keep the first with ``KL ≤ δ`` and ``L`` improved.

    On failure the parameters are restored to ``θ_old``. Returns ``(accepted, stats)`` where stats holds
    ``kl``, ``surrogate_improvement``, ``step_fraction`` (0 on failure) and ``backtracks``.
    """
    reduce = reduce or _identity
    old = parameters_to_vector(params).detach().clone()
    with torch.no_grad():
        surrogate_old = reduce(surrogate_fn().detach()).item()
        fraction = 1.0
        for k in range(max_backtracks):
            vector_to_parameters(old + fraction * full_step, params)
            surrogate = reduce(surrogate_fn().detach()).item()
            kl = reduce(kl_fn().detach()).item()
            if kl <= max_kl and surrogate > surrogate_old:
                return True, {
                    "kl": kl,
                    "surrogate_improvement": surrogate - surrogate_old,
                    "step_fraction": fraction,
                    "backtracks": float(k),
                }
            fraction *= backtrack_coef
        vector_to_parameters(old, params)
    return False, {"kl": 0.0, "surrogate_improvement": 0.0, "step_fraction": 0.0, "backtracks": float(max_backtracks)}


def trust_region_step(
    params: Sequence[nn.Parameter],
    surrogate_fn: Callable[[], Tensor],
    kl_fn: Callable[[], Tensor],
    max_kl: float,
    damping: float = 0.1,
    cg_iters: int = 10,
    line_search: bool = True,
    backtrack_coef: float = 0.8,
    max_backtracks: int = 10,
    reduce: Reduce | None = None,
    fvp: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, float]:
    """One TRPO step (``line_search=True``) or natural policy gradient step (``line_search=False``), in place.

    1. ``g = ∇L(θ_old)``;  2. ``x ≈ H⁻¹ g`` by conjugate gradient with Fisher-vector products;
    3. scale to the KL radius: ``Δθ = sqrt(2δ / xᵀHx) · x``;  4. TRPO: backtrack until ``KL ≤ δ`` and ``L``
    improves (else no step); NPG: take ``Δθ`` as is.

    Returns stats: ``kl`` (measured after the step), ``surrogate_improvement``, ``expected_improvement``
    (``g·Δθ``), ``step_fraction``, ``grad_norm``, ``cg_iters``, ``cg_residual``, ``accepted``.
    ``fvp``: a ready ``v ↦ (F + damping·I) v`` (already reduced over ranks) instead of double back-propagation
    through ``kl_fn`` — e.g. the Gauss–Newton form of an LLM's token KL (:mod:`spinwheel.rl.llm.algorithms.trpo`).
    """
    params = list(params)
    reduce = reduce or _identity
    g = reduce(flat_grad(surrogate_fn(), params))
    fvp = fvp or fisher_vector_product(kl_fn, params, damping, reduce)
    direction, cg_stats = conjugate_gradient(fvp, g, max_iters=cg_iters)
    full_step = kl_radius_scale(direction, fvp(direction), max_kl) * direction
    stats = {"grad_norm": g.norm().item(), "expected_improvement": torch.dot(g, full_step).item(), **cg_stats}
    if line_search:
        accepted, ls_stats = backtracking_line_search(
            params, full_step, surrogate_fn, kl_fn, max_kl, backtrack_coef, max_backtracks, reduce
        )
        return {**stats, **ls_stats, "accepted": float(accepted)}
    with torch.no_grad():
        surrogate_old = reduce(surrogate_fn().detach()).item()
        vector_to_parameters(parameters_to_vector(params) + full_step, params)
        surrogate = reduce(surrogate_fn().detach()).item()
        kl = reduce(kl_fn().detach()).item()
    return {
        **stats,
        "kl": kl,
        "surrogate_improvement": surrogate - surrogate_old,
        "step_fraction": 1.0,
        "backtracks": 0.0,
        "accepted": 1.0,
    }
