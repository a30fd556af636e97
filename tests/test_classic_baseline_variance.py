"""A learned state-value baseline leaves the policy-gradient estimate unbiased and lowers its variance.

References: Williams (1992) §8 (a baseline b(s) adds ``E[∇log π(a|s) b(s)] = 0`` to the gradient); Greensmith et al.,
"Variance Reduction Techniques for Gradient Estimates in RL" (JMLR 2004); Spinning Up's VPG (reward-to-go minus
a fitted V).

A fixed policy on a toy MDP of fixed horizon; spinwheel's own pieces make the estimates: ``ActorCritic.act`` rolls
out, ``RolloutBuffer.finish`` (GAE with λ = 1, i.e. reward-to-go minus the stored V(s_t)) makes the advantages,
``fit_value`` fits the critic beforehand on separate rollouts, and the gradient is that of
``policy_gradient_loss``, VPG's loss. The same batches give the estimate with the fitted baseline and without one
(stored values zeroed), so their difference is the baseline's own term, whose mean must be zero (Hotelling's T²
test); the trace of the covariance must drop by a clear factor. As a check of the test's power, a baseline that
looks at the action (V(s_{t+1}), which the action moves) must be rejected by the same test.
"""

import math

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor

from spinwheel.rl.classic.baseline import fit_value
from spinwheel.rl.classic.buffer import Batch, RolloutBuffer
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.optim import FlatAdam
from spinwheel.rl.classic.policies import MLP, ActorCritic
from spinwheel.rl.losses import explained_variance, policy_gradient_loss

H, GAMMA = 8, 0.99  # horizon (every episode terminates at its step H-1, no bootstrapping), discount
NUM_BATCHES, EPISODES_PER_BATCH = 200, 16
# The linear categorical actor's 9 parameters (W 3×2, b 3): the score of each action's row sums to zero over the
# rows, so the gradients live in 6 dimensions; the test statistic uses rows 0 and 1 of W and b.
INDEPENDENT = [0, 1, 2, 3, 6, 7]


def make_policy() -> ActorCritic:
    torch.manual_seed(0)
    policy = ActorCritic(gym.spaces.Box(-np.inf, np.inf, (2,), np.float32), gym.spaces.Discrete(3), hidden_sizes=())
    linear = policy.actor.net.layers[0]
    with torch.no_grad():  # obs (x, t/H) -> logits of moving left, staying, moving right
        linear.weight.copy_(torch.tensor([[-0.6, 0.2], [0.0, 0.0], [0.4, -0.3]]))
        linear.bias.copy_(torch.tensor([0.1, 0.3, -0.2]))
    policy.critic = MLP([2, 32, 32, 1], torch.tanh, out_gain=1.0)
    return policy


def rollout(policy: ActorCritic, num_envs: int, generator: torch.Generator) -> RolloutBuffer:
    """``num_envs`` episodes of the drift chain: ``x' = x + (a - 1)/2``, reward ``1 + x'``, ``x_0 ~ N(0, 1)``."""
    buffer = RolloutBuffer(H, num_envs, (2,), (), torch.int64)
    x = torch.randn(num_envs, generator=generator)
    no = np.zeros(num_envs, dtype=bool)
    for t in range(H):
        obs = torch.stack([x, torch.full_like(x, t / H)], dim=-1)
        actions, log_probs, values = policy.act(obs, torch.rand(num_envs, generator=generator))
        x = x + 0.5 * (actions - 1)
        buffer.add(t, obs, actions, log_probs, values, (1.0 + x).numpy(), no | (t == H - 1), no)
    return buffer


def finish_with(buffer: RolloutBuffer, values: Tensor) -> Batch:
    """The buffer's advantages with ``values`` stored as the baseline (``A_t = R_t - values[t]`` at λ = 1)."""
    buffer.values.copy_(values)
    return buffer.finish(torch.zeros(buffer.num_envs), GAMMA, lam=1.0)


def per_batch_gradients(policy: ActorCritic, batch: Batch, num_envs: int) -> Tensor:
    """``(NUM_BATCHES, 9)``: ``-∇ policy_gradient_loss`` of each group of ``EPISODES_PER_BATCH`` episodes."""
    actor, params = policy.actor, list(policy.actor.parameters())

    def steps(x: Tensor, b: int) -> Tensor:  # samples t * N + i of episodes i in batch b, all t
        cols = slice(b * EPISODES_PER_BATCH, (b + 1) * EPISODES_PER_BATCH)
        return x.reshape(H, num_envs, *x.shape[1:])[:, cols].reshape(-1, *x.shape[1:])

    rows = []
    for b in range(NUM_BATCHES):
        log_probs = actor.log_prob(actor(steps(batch.obs, b)), steps(batch.actions, b))
        loss, _ = policy_gradient_loss(log_probs, steps(batch.advantages, b))
        rows.append(-torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows).double()


def hotelling_p_value(d: Tensor) -> tuple[float, float]:
    """One-sample Hotelling T² of ``H0: E[d] = 0`` for rows ``d`` ``(n, p)``; returns ``(T², p-value)``.

    ``F = (n - p) / (p (n - 1)) · T²`` follows ``F(p, n - p)``; its tail is the regularised incomplete beta
    ``I_x((n - p)/2, p/2)`` at ``x = (n - p) / (n - p + p F)``, integrated here numerically.
    """
    n, p = d.shape
    mean = d.mean(0)
    t2 = (n * mean @ torch.linalg.pinv(torch.cov(d.T), hermitian=True) @ mean).item()  # 0 if d is all zeros
    f = (n - p) / (p * (n - 1)) * t2
    a, b = (n - p) / 2, p / 2
    s = torch.linspace(0.0, (n - p) / (n - p + p * f), 100_001, dtype=torch.float64)[1:]
    log_density = (a - 1) * s.log() + (b - 1) * torch.log1p(-s) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    return t2, torch.trapezoid(torch.cat([torch.zeros(1, dtype=s.dtype), log_density.exp()]), dx=s[0].item()).item()


def test_value_baseline_is_unbiased_and_lowers_the_variance():
    torch.set_num_threads(1)
    policy = make_policy()
    generator = torch.Generator().manual_seed(0)

    fit = finish_with(rollout(policy, 1024, generator), torch.zeros(H, 1024))  # its own data: b independent of a
    optimizer = FlatAdam(policy.critic.parameters(), lr=3e-3)
    fit_value(policy.critic, optimizer, fit.obs, fit.rewards_to_go, 40, 256, 1024, generator, DataParallel())

    num_envs = NUM_BATCHES * EPISODES_PER_BATCH
    buffer = rollout(policy, num_envs, generator)
    v_s = buffer.values.clone()  # V(s_t) at rollout time, with the fitted critic
    v_next = torch.cat([v_s[1:], torch.zeros(1, num_envs)])  # V(s_{t+1}); 0 past the terminal step
    plain = per_batch_gradients(policy, finish_with(buffer, torch.zeros_like(v_s)), num_envs)
    baselined = finish_with(buffer, v_s)
    with_baseline = per_batch_gradients(policy, baselined, num_envs)
    action_dependent = per_batch_gradients(policy, finish_with(buffer, v_next), num_envs)
    fit_quality = explained_variance(v_s.reshape(-1), baselined.rewards_to_go).item()

    t2, p_value = hotelling_p_value((plain - with_baseline)[:, INDEPENDENT])
    _, p_signal = hotelling_p_value(with_baseline[:, INDEPENDENT])
    _, p_biased = hotelling_p_value((action_dependent - with_baseline)[:, INDEPENDENT])
    ratio = (torch.cov(plain.T).trace() / torch.cov(with_baseline.T).trace()).item()
    diff = (plain - with_baseline).mean(0)
    max_z = (diff / (plain - with_baseline).std(0) * math.sqrt(NUM_BATCHES))[INDEPENDENT].abs().max().item()
    print(
        f"explained variance of V {fit_quality:.3f}; variance ratio {ratio:.1f}; "
        f"mean difference T² = {t2:.2f} (p = {p_value:.3f}, max |z| = {max_z:.2f}); "
        f"gradient ≠ 0: p = {p_signal:.1e}; action-dependent baseline: p = {p_biased:.1e}"
    )
    assert fit_quality > 0.8, "the baseline is not a reasonably fitted V"
    assert p_signal < 1e-6, "the gradient is too close to zero for the agreement below to mean anything"
    assert p_value > 0.01, f"the estimates with and without the baseline differ in mean: T² = {t2:.1f}"
    assert ratio > 5.0, f"the baseline lowers the variance by only ×{ratio:.2f}"
    assert p_biased < 1e-6, "the test cannot see the bias of a baseline that depends on the action"
