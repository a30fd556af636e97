"""Trust-region step: CG solves SPD systems, FVP equals the explicit KL Hessian, the step respects KL ≤ δ."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parameters_to_vector

from spinwheel.rl.trpo import (
    backtracking_line_search,
    conjugate_gradient,
    fisher_vector_product,
    flat_grad,
    kl_radius_scale,
    trust_region_step,
)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40))
def test_conjugate_gradient_solves_random_spd_systems(seed, n):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    eigenvalues = torch.rand(n, generator=g, dtype=torch.float64) * 9 + 1  # condition number ≤ 10
    A = q @ torch.diag(eigenvalues) @ q.T
    b = torch.randn(n, generator=g, dtype=torch.float64)
    x, stats = conjugate_gradient(lambda v: A @ v, b, max_iters=2 * n, residual_tol=1e-20)
    torch.testing.assert_close(x, torch.linalg.solve(A, b), rtol=1e-8, atol=1e-8)
    assert torch.linalg.norm(A @ x - b) <= 1e-8 * torch.linalg.norm(b)
    assert stats["cg_iters"] <= 2 * n


def test_conjugate_gradient_stops_at_max_iters():
    A = torch.diag(torch.arange(1.0, 11.0, dtype=torch.float64))
    x, stats = conjugate_gradient(lambda v: A @ v, torch.ones(10, dtype=torch.float64), max_iters=3)
    assert stats["cg_iters"] == 3 and stats["cg_residual"] > 1e-10


class TinyPolicy(nn.Module):
    """A categorical policy over 3 actions from 2 features."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3))

    def forward(self, obs):
        return torch.log_softmax(self.net(obs), -1)


def make_problem(seed=0, n=64):
    """A policy, its surrogate and KL closures, and the data they close over."""
    torch.manual_seed(seed)
    policy = TinyPolicy().double()
    obs = torch.randn(n, 2, dtype=torch.float64)
    with torch.no_grad():
        logp_old_all = policy(obs)
        actions = torch.multinomial(logp_old_all.exp(), 1).squeeze(-1)
        logp_old = logp_old_all.gather(-1, actions[:, None]).squeeze(-1)
    advantages = torch.randn(n, dtype=torch.float64)

    def surrogate():
        logp = policy(obs).gather(-1, actions[:, None]).squeeze(-1)
        return (torch.exp(logp - logp_old) * advantages).mean()

    def kl():
        logp = policy(obs)
        return (logp_old_all.exp() * (logp_old_all - logp)).sum(-1).mean()

    return policy, surrogate, kl, (obs, logp_old_all)


def test_fisher_vector_product_equals_explicit_hessian():
    policy, _, kl, (obs, logp_old_all) = make_problem()
    params = list(policy.parameters())
    theta = parameters_to_vector(params).detach()
    shapes = [p.shape for p in params]

    def kl_of_flat(v):
        """The same mean KL as a function of the flat parameter vector."""
        chunks, offset = [], 0
        for shape in shapes:
            chunks.append(v[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()
        w1, b1, w2, b2 = chunks
        logp = torch.log_softmax(torch.tanh(obs @ w1.T + b1) @ w2.T + b2, -1)
        return (logp_old_all.exp() * (logp_old_all - logp)).sum(-1).mean()

    assert abs(kl_of_flat(theta).item()) < 1e-12  # KL(old ‖ old) = 0
    H = torch.autograd.functional.hessian(kl_of_flat, theta)
    damping = 0.1
    fvp = fisher_vector_product(kl, params, damping)
    v = torch.randn(theta.numel(), dtype=torch.float64)
    torch.testing.assert_close(fvp(v), H @ v + damping * v, rtol=1e-8, atol=1e-10)


def test_kl_radius_scale_puts_the_quadratic_model_on_the_boundary():
    H = torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64))
    x = torch.tensor([1.0, 1.0], dtype=torch.float64)
    beta = kl_radius_scale(x, H @ x, max_kl=0.01)
    step = beta * x
    assert (0.5 * step @ H @ step).item() == pytest.approx(0.01)
    assert beta.item() == pytest.approx((2 * 0.01 / 5) ** 0.5)


@pytest.mark.parametrize("max_kl", [0.001, 0.01, 0.05])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trpo_step_respects_the_kl_radius_and_improves_the_surrogate(seed, max_kl):
    policy, surrogate, kl, _ = make_problem(seed)
    params = list(policy.parameters())
    before = surrogate().item()
    stats = trust_region_step(params, surrogate, kl, max_kl=max_kl, damping=0.01, cg_iters=10)
    assert stats["accepted"] == 1.0
    measured = kl().item()  # KL(old ‖ new), recomputed independently of the step's own bookkeeping
    assert 0.0 < measured <= max_kl
    assert measured == pytest.approx(stats["kl"])
    assert surrogate().item() > before
    assert stats["expected_improvement"] > 0


def test_natural_gradient_step_lands_on_the_radius_without_line_search():
    policy, surrogate, kl, _ = make_problem(3)
    params = list(policy.parameters())
    theta = parameters_to_vector(params).detach().clone()
    fisher = fisher_vector_product(kl, params, damping=0.0)  # H at θ_old, before the step
    damping, max_kl = 0.01, 1e-6
    stats = trust_region_step(params, surrogate, kl, max_kl=max_kl, damping=damping, cg_iters=50, line_search=False)
    step = parameters_to_vector(params).detach() - theta
    h_step = fisher(step).detach()
    # The step sits on the boundary of the damped quadratic model: ½ sᵀ(H + λI)s = δ ...
    assert (0.5 * step @ (h_step + damping * step)).item() == pytest.approx(max_kl, rel=1e-6)
    # ... and for a small radius the true KL is the undamped quadratic ½ sᵀHs.
    assert kl().item() == pytest.approx((0.5 * step @ h_step).item(), rel=0.02)
    assert stats["step_fraction"] == 1.0 and stats["surrogate_improvement"] > 0


def test_line_search_rejects_a_step_that_cannot_improve_and_restores_the_parameters():
    policy, surrogate, kl, _ = make_problem(4)
    params = list(policy.parameters())
    theta = parameters_to_vector(params).detach().clone()
    g = flat_grad(surrogate(), params)
    accepted, stats = backtracking_line_search(params, -g, surrogate, kl, max_kl=1.0)  # a descent direction
    assert not accepted and stats["step_fraction"] == 0.0
    torch.testing.assert_close(parameters_to_vector(params).detach(), theta, rtol=0, atol=0)


def test_line_search_backtracks_until_the_kl_fits():
    policy, surrogate, kl, _ = make_problem(5)
    params = list(policy.parameters())
    g = flat_grad(surrogate(), params)
    accepted, stats = backtracking_line_search(
        params, 50 * g / g.norm(), surrogate, kl, max_kl=0.01, backtrack_coef=0.5, max_backtracks=30
    )
    assert accepted and stats["backtracks"] > 0
    assert kl().item() <= 0.01
