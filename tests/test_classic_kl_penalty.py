"""PPO-Penalty: the loss against the paper's formula written out by hand, the adaptive β, learning, data parallel.

Reference: Schulman et al., "Proximal Policy Optimization Algorithms" (2017), §4 (eq. 8 and the β rule).
"""

import json
import math
import os

import gymnasium as gym
import pytest
import torch

from spinwheel.parallel.launch import spawn
from spinwheel.rl.classic import ClassicConfig, train
from spinwheel.rl.classic.kl_penalty import adapt_kl_coef, ppo_penalty_loss
from spinwheel.rl.classic.policies import ActorCritic


def quiet(**kwargs) -> ClassicConfig:
    kwargs = {"algo": "ppo", "ppo_variant": "penalty", "progress": False, **kwargs}
    return ClassicConfig(**kwargs)


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def naive_penalty_objective(logits_old, logits_new, actions, advantages, beta):
    """L^KLPEN of eq. 8, sample by sample in plain Python: mean(r·A) - β·mean(Σ_a p_old log(p_old / p_new))."""
    total_surrogate, total_kl = 0.0, 0.0
    for lo, ln, a, adv in zip(logits_old.tolist(), logits_new.tolist(), actions.tolist(), advantages.tolist()):
        p_old = [math.exp(x) / sum(math.exp(y) for y in lo) for x in lo]
        p_new = [math.exp(x) / sum(math.exp(y) for y in ln) for x in ln]
        total_surrogate += p_new[a] / p_old[a] * adv
        total_kl += sum(po * math.log(po / pn) for po, pn in zip(p_old, p_new))
    n = len(actions)
    return total_surrogate / n - beta * total_kl / n, total_surrogate / n, total_kl / n


@pytest.mark.parametrize("beta", [0.0, 0.3, 3.0])
def test_penalty_loss_equals_the_formula(beta):
    torch.manual_seed(1)
    actor = ActorCritic(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(4)).actor
    logits_old, logits_new = torch.randn(9, 4), torch.randn(9, 4, requires_grad=True)
    actions, advantages = torch.randint(0, 4, (9,)), torch.randn(9)
    pd_old, pd_new = torch.log_softmax(logits_old, -1), torch.log_softmax(logits_new, -1)
    loss, stats = ppo_penalty_loss(
        actor.log_prob(pd_new, actions), actor.log_prob(pd_old, actions), advantages, actor.kl(pd_old, pd_new), beta
    )
    objective, surrogate, kl = naive_penalty_objective(logits_old, logits_new.detach(), actions, advantages, beta)
    assert loss.item() == pytest.approx(-objective, rel=1e-6, abs=1e-6)
    assert stats["surrogate"].item() == pytest.approx(surrogate, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(kl, rel=1e-6)
    # The gradient equals that of the same objective built from torch.distributions.
    (grad,) = torch.autograd.grad(loss, logits_new)
    new, old = torch.distributions.Categorical(logits=logits_new), torch.distributions.Categorical(logits=logits_old)
    ratio = torch.exp(new.log_prob(actions) - old.log_prob(actions))
    reference = -(ratio * advantages).mean() + beta * torch.distributions.kl_divergence(old, new).mean()
    (reference_grad,) = torch.autograd.grad(reference, logits_new)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-5, atol=1e-7)


def test_penalty_loss_at_the_old_policy_is_the_advantage_mean():
    logp = torch.randn(6)
    advantages = torch.randn(6)
    loss, stats = ppo_penalty_loss(logp, logp, advantages, torch.zeros(6), beta=5.0)
    assert loss.item() == pytest.approx(-advantages.mean().item(), abs=1e-7)
    assert stats["approx_kl"].item() == 0.0 and stats["ratio_mean"].item() == 1.0


@pytest.mark.parametrize(
    "kl,expected", [(0.001, 0.5), (0.0066, 0.5), (0.0067, 1.0), (0.01, 1.0), (0.015, 1.0), (0.0151, 2.0), (0.2, 2.0)]
)
def test_adaptive_beta_halves_below_and_doubles_above_the_band(kl, expected):
    assert adapt_kl_coef(1.0, kl, kl_target=0.01) == expected  # band: [0.01 / 1.5, 0.01 * 1.5]
    assert adapt_kl_coef(0.25, kl, kl_target=0.0) == 0.25  # target 0: a fixed β


def test_config_refuses_the_variant_outside_ppo_and_a_bad_beta():
    with pytest.raises(ValueError, match="applies to --algo ppo"):
        ClassicConfig(algo="trpo", ppo_variant="penalty")
    with pytest.raises(ValueError, match="penalty_beta"):
        quiet(penalty_beta=0.0)
    with pytest.raises(ValueError, match="ppo_variant"):
        quiet(ppo_variant="adaptive")


SMALL = dict(
    env="CartPole-v1",
    steps=4 * 64 * 4,
    num_envs=4,
    num_steps=64,
    minibatch_size=64,
    update_epochs=3,
    lr=3e-3,
    eval_episodes=0,
)


def test_beta_follows_the_rule_from_each_update_kl(tmp_path):
    train(quiet(out_dir=str(tmp_path), penalty_beta=0.5, penalty_kl_target=0.003, **SMALL))
    records = read_metrics(tmp_path)[:-1]
    assert len(records) == 4 and records[0]["kl_beta"] == 0.5
    for before, after in zip(records, records[1:]):
        assert before["kl"] > 0
        assert after["kl_beta"] == adapt_kl_coef(before["kl_beta"], before["kl"], 0.003)
    assert len({r["kl_beta"] for r in records}) > 1  # the settings make β move


@pytest.mark.slow
def test_ppo_penalty_learns_cartpole(tmp_path):
    result = train(
        quiet(
            env="CartPole-v1",
            steps=25_000,
            seed=0,
            num_envs=8,
            num_steps=256,
            minibatch_size=256,
            update_epochs=10,
            lr=1e-3,
            eval_episodes=5,
            out_dir=str(tmp_path),
        )
    )
    first = [r["episode_return_mean"] for r in read_metrics(tmp_path)[:2] if r.get("episode_return_mean")]
    assert sum(first) / len(first) < 40  # a random CartPole policy lasts ~20 steps
    assert result["eval_return_mean"] >= 150, result


def _penalty_rank(rank: int, world_size: int, out_root: str) -> None:
    torch.set_num_threads(1)
    train(quiet(out_dir=os.path.join(out_root, "dp"), dist_timeout_s=60, **SMALL))


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_penalty_equals_single_process(tmp_path):
    spawn(_penalty_rank, 2, args=(str(tmp_path),), timeout_s=150)
    train(quiet(out_dir=str(tmp_path / "single"), **SMALL))
    single = torch.load(tmp_path / "single" / "policy.pt", weights_only=False)["state_dict"]
    parallel = torch.load(tmp_path / "dp" / "policy.pt", weights_only=False)["state_dict"]
    for name, value in single.items():
        torch.testing.assert_close(parallel[name], value, rtol=1e-5, atol=1e-5, msg=name)
    for a, b in zip(read_metrics(tmp_path / "single")[:-1], read_metrics(tmp_path / "dp")[:-1]):
        assert b["kl_beta"] == a["kl_beta"]
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-7)
