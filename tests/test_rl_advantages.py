"""GAE-λ and reward-to-go: vectorised functions against a plain Python loop over every step of every env."""

import doctest

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spinwheel.rl.advantages as adv_module
from spinwheel.rl.advantages import discount_cumsum, gae, normalize, reward_to_go


def loop_gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """One env at a time, one step at a time, with explicit branches for each kind of episode end."""
    T, N = len(rewards), len(rewards[0])
    advantages = [[0.0] * N for _ in range(T)]
    for i in range(N):
        running = 0.0
        for t in reversed(range(T)):
            if terminated[t][i]:
                delta = rewards[t][i] - values[t][i]  # no future after a terminal state
                running = delta
            elif truncated[t][i]:
                delta = rewards[t][i] + gamma * next_values[t][i] - values[t][i]  # bootstrap, start afresh
                running = delta
            else:
                delta = rewards[t][i] + gamma * next_values[t][i] - values[t][i]
                running = delta + gamma * lam * running
            advantages[t][i] = running
    returns = [[advantages[t][i] + values[t][i] for i in range(N)] for t in range(T)]
    return advantages, returns


def loop_reward_to_go(rewards, next_values, terminated, truncated, gamma):
    T, N = len(rewards), len(rewards[0])
    out = [[0.0] * N for _ in range(T)]
    for i in range(N):
        running = 0.0
        for t in reversed(range(T)):
            if terminated[t][i]:
                running = rewards[t][i]
            elif truncated[t][i]:
                running = rewards[t][i] + gamma * next_values[t][i]
            else:
                running = rewards[t][i] + gamma * running
            out[t][i] = running
    return out


def random_rollout(seed, T, N, p_term=0.1, p_trunc=0.1):
    g = np.random.default_rng(seed)
    rewards = g.normal(size=(T, N))
    values = g.normal(size=(T, N))
    next_values = g.normal(size=(T, N))
    terminated = g.random((T, N)) < p_term
    truncated = (g.random((T, N)) < p_trunc) & ~terminated
    truncated[-1] |= ~terminated[-1]  # the rollout end is a cut
    return rewards, values, next_values, terminated, truncated


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    T=st.integers(1, 40),
    N=st.integers(1, 5),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_equals_python_loop(seed, T, N, gamma, lam):
    r, v, nv, term, trunc = random_rollout(seed, T, N)
    expected_adv, expected_ret = loop_gae(
        r.tolist(), v.tolist(), nv.tolist(), term.tolist(), trunc.tolist(), gamma, lam
    )
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    advantages, returns = gae(t(r), t(v), t(nv), torch.tensor(term), torch.tensor(trunc), gamma, lam)
    torch.testing.assert_close(advantages, t(expected_adv), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns, t(expected_ret), rtol=1e-10, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), T=st.integers(1, 40), N=st.integers(1, 5), gamma=st.floats(0.5, 1.0))
def test_reward_to_go_equals_python_loop(seed, T, N, gamma):
    r, _, nv, term, trunc = random_rollout(seed, T, N)
    expected = loop_reward_to_go(r.tolist(), nv.tolist(), term.tolist(), trunc.tolist(), gamma)
    out = reward_to_go(torch.tensor(r), torch.tensor(nv), torch.tensor(term), torch.tensor(trunc), gamma)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-10)


def test_truncation_bootstraps_and_termination_does_not():
    # One step each, reward 1, V(s_{t+1}) = 10, γ = 0.5.
    r = torch.ones(1, 1)
    nv = torch.full((1, 1), 10.0)
    no = torch.zeros(1, 1, dtype=torch.bool)
    yes = torch.ones(1, 1, dtype=torch.bool)
    assert reward_to_go(r, nv, yes, no, 0.5).item() == 1.0  # terminated: nothing after
    assert reward_to_go(r, nv, no, yes, 0.5).item() == 6.0  # truncated: 1 + 0.5 · 10
    assert reward_to_go(r, nv, yes, yes, 0.5).item() == 1.0  # both: termination wins
    zero = torch.zeros(1, 1)
    assert gae(r, zero, nv, yes, no, 0.5, 0.9)[0].item() == 1.0
    assert gae(r, zero, nv, no, yes, 0.5, 0.9)[0].item() == 6.0


def test_episode_boundary_stops_the_recursion():
    # Two steps; the first ends an episode (truncated): step 0 must not see step 1's reward.
    r = torch.tensor([[1.0], [100.0]])
    nv = torch.tensor([[2.0], [0.0]])
    term = torch.tensor([[False], [True]])
    trunc = torch.tensor([[True], [False]])
    assert reward_to_go(r, nv, term, trunc, 0.5)[0].item() == 2.0  # 1 + 0.5·2, not 1 + 0.5·100
    advantages, _ = gae(r, torch.zeros(2, 1), nv, term, trunc, 0.5, 1.0)
    assert advantages[0].item() == 2.0


def test_lambda_one_gives_reward_to_go_and_lambda_zero_gives_td_errors():
    r, v, nv, term, trunc = (torch.as_tensor(x) for x in random_rollout(3, 30, 4))
    # Inside an episode V(s_{t+1}) is the next step's value; the telescoping sum needs that.
    done = term | trunc
    nv[:-1] = torch.where(done[:-1], nv[:-1], v[1:])
    _, returns = gae(r, v, nv, term, trunc, 0.9, 1.0)
    torch.testing.assert_close(returns, reward_to_go(r, nv, term, trunc, 0.9))
    advantages, _ = gae(r, v, nv, term, trunc, 0.9, 0.0)
    torch.testing.assert_close(advantages, r + 0.9 * (~term) * nv - v)


def test_discount_cumsum_and_normalize():
    x = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(discount_cumsum(x, 0.5), torch.tensor([1 + 1 + 0.75, 2 + 1.5, 3.0]))
    torch.testing.assert_close(discount_cumsum(x, 1.0), torch.tensor([6.0, 5.0, 3.0]))
    y = normalize(torch.tensor([1.0, 5.0, 9.0, 2.0]))
    assert abs(y.mean().item()) < 1e-6 and abs(y.std(unbiased=False).item() - 1) < 1e-6


def test_docstring_examples():
    result = doctest.testmod(adv_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 3
    assert result.failed == 0


@pytest.mark.parametrize("shape", [(7,), (7, 3), (7, 2, 2)])
def test_any_trailing_batch_shape(shape):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(shape, generator=g)
    term = torch.rand(shape, generator=g) < 0.2
    trunc = torch.zeros(shape, dtype=torch.bool)
    flat = reward_to_go(r.reshape(7, -1), torch.zeros(7, r[0].numel()), term.reshape(7, -1), trunc.reshape(7, -1), 0.9)
    torch.testing.assert_close(reward_to_go(r, torch.zeros(shape), term, trunc, 0.9).reshape(7, -1), flat)
