"""PPO's combined objective against eq. 9 of the paper, written out here by hand.

Reference: Schulman et al., "Proximal Policy Optimization Algorithms" (2017), eq. 9:
``L^{CLIP+VF+S}(θ) = E_t[L^CLIP_t(θ) - c1 L^VF_t(θ) + c2 S[π_θ](s_t)]``, maximised; spinwheel minimises its
negation with ``c1 = vf_coef`` and ``c2 = ent_coef``. One optimizer steps the actor and the critic together, so
gradient clipping sees the global norm of both (Huang et al. 2022, "37 implementation details", #11).

On fixed hand-made inputs: the loss :meth:`PPO.loss` builds equals the formula and so do its gradients with
respect to every parameter; two calls of :meth:`PPO.update` (one minibatch of the whole batch each) equal two
steps of ``torch.optim.Adam`` over all parameters on the formula, with the global gradient-norm clip.
"""

import copy
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from spinwheel.rl.classic import ClassicConfig
from spinwheel.rl.classic.buffer import Batch
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.policies import ActorCritic
from spinwheel.rl.classic.ppo import PPO

VF_COEF, ENT_COEF, CLIP, B = 0.7, 0.05, 0.2, 12


def make_policy(discrete: bool) -> ActorCritic:
    torch.manual_seed(0)
    obs_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    act_space = gym.spaces.Discrete(3) if discrete else gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    policy = ActorCritic(obs_space, act_space, hidden_sizes=(8,))
    with torch.no_grad():  # a last layer far from the near-uniform init, so the policy terms are not tiny
        policy.actor.net.layers[-1].weight.normal_(0.0, 1.0)
        if not discrete:
            policy.actor.log_std.copy_(torch.tensor([-0.3, 0.2]))
    return policy


def make_batch(policy: ActorCritic) -> Batch:
    """Fixed rollout data whose ratios fall on both sides of the clip range and whose values leave ±ε_V."""
    g = torch.Generator().manual_seed(1)
    obs = torch.randn(B, 3, generator=g)
    with torch.no_grad():
        pd = policy.actor(obs)
        if policy.discrete:
            actions = torch.randint(0, 3, (B,), generator=g)
        else:
            actions = torch.randn(B, 2, generator=g)
        log_probs_now = policy.actor.log_prob(pd, actions)
        values_now = policy.value(obs)
    old_log_probs = log_probs_now + 0.4 * torch.randn(B, generator=g)
    old_values = values_now + 0.5 * torch.randn(B, generator=g)
    advantages = torch.randn(B, generator=g)
    returns = old_values + advantages
    return Batch(obs, actions, old_log_probs, old_values, advantages, returns, None)


def paper_objective(policy: ActorCritic, batch: Batch, advantages, clip_range_vf) -> tuple:
    """``-(L^CLIP - c1 L^VF + c2 S)`` from the definitions, not from spinwheel's loss functions."""
    out = policy.actor.net(batch.obs)
    if policy.discrete:
        log_p = out - out.logsumexp(-1, keepdim=True)  # log π(·|s)
        log_prob = log_p[torch.arange(B), batch.actions]
        entropy = -(log_p.exp() * log_p).sum(-1)
    else:
        mean, log_std = out, policy.actor.log_std
        var = torch.exp(2 * log_std)
        log_prob = (-((batch.actions - mean) ** 2) / (2 * var) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 * torch.log(2 * math.pi * math.e * var)).sum().expand(B)
    r = torch.exp(log_prob - batch.log_probs)  # r_t(θ) = π_θ(a|s) / π_θold(a|s)
    l_clip = torch.min(r * advantages, torch.clamp(r, 1 - CLIP, 1 + CLIP) * advantages).mean()
    v = policy.critic(batch.obs)[:, 0]
    l_vf_terms = (v - batch.returns) ** 2
    if clip_range_vf is not None:  # OpenAI baselines ppo2: the pessimistic max over the clipped prediction
        v_clipped = batch.values + torch.clamp(v - batch.values, -clip_range_vf, clip_range_vf)
        l_vf_terms = torch.max(l_vf_terms, (v_clipped - batch.returns) ** 2)
    l_vf, s = l_vf_terms.mean(), entropy.mean()
    return -(l_clip - VF_COEF * l_vf + ENT_COEF * s), (l_clip, l_vf, s, r, v)


def config(**kwargs) -> ClassicConfig:
    kwargs = dict(algo="ppo", vf_coef=VF_COEF, ent_coef=ENT_COEF, clip_range=CLIP, progress=False, **kwargs)
    return ClassicConfig(**kwargs)


def assert_both_branches_active(batch: Batch, r, v, clip_range_vf) -> None:
    """The inputs exercise the clip: some ratios inside, some outside; some values clipped, some not."""
    outside = (r - 1).abs() > CLIP
    assert 0 < outside.sum() < B
    if clip_range_vf is not None:
        far = (v - batch.values).abs() > clip_range_vf
        assert 0 < far.sum() < B


@pytest.mark.parametrize("discrete", [True, False], ids=["categorical", "gaussian"])
@pytest.mark.parametrize("clip_range_vf", [None, 0.2], ids=["vf", "vf_clipped"])
def test_ppo_loss_and_its_gradient_equal_eq9(discrete, clip_range_vf):
    policy = make_policy(discrete)
    batch = make_batch(policy)
    ppo = PPO(policy, config(clip_range_vf=clip_range_vf), DataParallel())
    params = list(policy.parameters())

    loss, stats = ppo.loss(batch, slice(None), batch.advantages, None)
    expected, (l_clip, l_vf, s, r, v) = paper_objective(policy, batch, batch.advantages, clip_range_vf)
    assert_both_branches_active(batch, r, v, clip_range_vf)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats[:3], torch.stack([-l_clip, l_vf, s]).detach(), rtol=1e-6, atol=1e-7)

    grads = torch.autograd.grad(loss, params)
    expected_grads = torch.autograd.grad(expected, params)
    for p, g, e in zip(params, grads, expected_grads):
        assert e.abs().sum() > 0  # every parameter, the actor's and the critic's, is in the one objective
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("clip_range_vf", [None, 0.2], ids=["vf", "vf_clipped"])
def test_ppo_update_is_one_adam_over_actor_and_critic_on_eq9(clip_range_vf):
    """Two updates = two steps of one Adam (eps 1e-5) over all parameters, on eq. 9 with the per-minibatch
    advantage normalisation ``(A - mean) / (std + 1e-8)`` and the global gradient-norm clip at 0.5."""
    policy = make_policy(discrete=True)
    batch = make_batch(policy)
    reference = copy.deepcopy(policy)
    lr, max_grad_norm = 0.01, 0.5
    cfg = config(
        clip_range_vf=clip_range_vf,
        lr=lr,
        update_epochs=1,
        minibatch_size=B,
        norm_adv=True,
        max_grad_norm=max_grad_norm,
    )
    ppo = PPO(policy, cfg, DataParallel())
    adam = torch.optim.Adam(reference.parameters(), lr=lr, eps=1e-5)
    advantages = (batch.advantages - batch.advantages.mean()) / (batch.advantages.std() + 1e-8)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        adam.zero_grad()
        paper_objective(reference, batch, advantages, clip_range_vf)[0].backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
        assert norm > max_grad_norm  # the joint clip is active, so a per-network clip would differ
        adam.step()
        ppo.update(batch, num_envs=B, generator=generator, lr_scale=1.0)
        for p, q in zip(policy.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        clipped_grad = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        torch.testing.assert_close(ppo.optimizer.grad, clipped_grad, rtol=1e-5, atol=1e-7)
