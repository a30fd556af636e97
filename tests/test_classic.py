"""Classic-control trainers: buffer bootstrapping, envs, normalisation, policies, optimizer, config, training.

The learning tests are seeded and sized to run in seconds; the data-parallel test spawns two gloo ranks and
compares their result with a one-process run of the same total batch.
"""

import copy
import json
import math
import os
import socket
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

from spinwheel.parallel.launch import rank_context
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.classic import ClassicConfig, load_policy, train
from spinwheel.rl.classic.buffer import RolloutBuffer
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.envs import RunningMeanStd, VecEnv, evaluate_policy
from spinwheel.rl.classic.optim import FlatAdam
from spinwheel.rl.classic.policies import ActorCritic

torch.set_num_threads(1)

# CartPole settings that learn in a few thousand steps (PPO: the rl-baselines3-zoo tuning).
PPO_CARTPOLE = dict(num_envs=8, num_steps=32, minibatch_size=256, update_epochs=20, gae_lambda=0.8, gamma=0.98, lr=1e-3)


def quiet(**kwargs) -> ClassicConfig:
    kwargs.setdefault("progress", False)
    return ClassicConfig(**kwargs)


# --- buffer: bootstrapping at truncation, not at termination -------------------------------------------------


def loop_targets(rewards, values, final_values, last_values, terminated, truncated, gamma, lam):
    """Per env, per step: GAE and reward-to-go written from the rules in buffer.py's docstring."""
    T, N = rewards.shape
    adv = np.zeros((T, N))
    rtg = np.zeros((T, N))
    for i in range(N):
        a = g = 0.0
        for t in reversed(range(T)):
            if terminated[t, i]:
                next_value, cut = 0.0, True
            elif truncated[t, i]:
                next_value, cut = final_values[t, i], True
            elif t == T - 1:
                next_value, cut = last_values[i], True
            else:
                next_value, cut = values[t + 1, i], False
            delta = rewards[t, i] + gamma * next_value - values[t, i]
            a = delta if cut else delta + gamma * lam * a
            g = rewards[t, i] + gamma * next_value if cut else rewards[t, i] + gamma * g
            adv[t, i], rtg[t, i] = a, g
    return adv, rtg


@pytest.mark.parametrize("seed", range(5))
def test_buffer_targets_equal_a_python_loop(seed):
    rng = np.random.default_rng(seed)
    T, N, gamma, lam = 20, 3, 0.9, 0.8
    rewards = rng.normal(size=(T, N))
    values = rng.normal(size=(T, N)).astype(np.float32)
    final_values = rng.normal(size=(T, N)).astype(np.float32)
    last_values = rng.normal(size=N).astype(np.float32)
    terminated = rng.random((T, N)) < 0.1
    truncated = (rng.random((T, N)) < 0.1) & ~terminated
    terminated[-1, 0], truncated[-1, 1] = True, True  # rollout ends on each kind of episode end

    buffer = RolloutBuffer(T, N, (2,), (), torch.int64)
    for t in range(T):
        bootstrap = torch.from_numpy(np.where(truncated[t], final_values[t], 0).astype(np.float32))
        buffer.add(
            t,
            torch.zeros(N, 2),
            torch.zeros(N, dtype=torch.int64),
            torch.zeros(N),
            torch.from_numpy(values[t]),
            rewards[t],
            terminated[t],
            truncated[t],
            bootstrap,
        )
    batch = buffer.finish(torch.from_numpy(last_values), gamma, lam)
    adv, rtg = loop_targets(
        rewards.astype(np.float32), values, final_values, last_values, terminated, truncated, gamma, lam
    )
    np.testing.assert_allclose(batch.advantages.numpy().reshape(T, N), adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch.rewards_to_go.numpy().reshape(T, N), rtg, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch.returns.numpy(), (batch.advantages + batch.values).numpy())


# --- environments and normalisation ----------------------------------------------------------------------------


def test_vec_env_keeps_final_observation_and_flags_truncation():
    env = VecEnv("Pendulum-v1", 2, seed=3)  # Pendulum never terminates; TimeLimit truncates at 200
    env.reset()
    for t in range(200):
        step = env.step(np.zeros((2, 1), dtype=np.float32))
        if t < 199:
            assert not step.truncated.any() and not step.terminated.any()
    assert step.truncated.all() and not step.terminated.any()
    assert len(step.episode_returns) == 2 and step.episode_lengths == [200, 200]
    assert not np.allclose(step.final_obs, step.obs)  # obs is already the reset of the next episode
    reference = gym.make("Pendulum-v1")
    reference.reset(seed=4)  # env 1 is seeded seed + 1
    for _ in range(200):
        final, *_ = reference.step(np.zeros(1, dtype=np.float32))
    np.testing.assert_allclose(step.final_obs[1], final, rtol=1e-6)


def test_vec_env_termination_and_episode_returns():
    env = VecEnv("CartPole-v1", 3, seed=0, env_offset=5)
    env.reset()
    returns, terminated_seen = [], False
    for _ in range(300):
        step = env.step(np.zeros(3, dtype=np.int64))  # always push left: falls within ~10 steps
        returns += step.episode_returns
        terminated_seen |= bool(step.terminated.any())
        assert not (step.terminated & step.truncated).any()
    assert terminated_seen and all(8 <= r <= 30 for r in returns)


def test_running_mean_std_equals_numpy_over_all_batches():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 4)) for n in (5, 17, 1, 40)]
    rms = RunningMeanStd((4,))
    for b in batches:
        rms.update(torch.from_numpy(b))
    everything = np.concatenate(batches)
    np.testing.assert_allclose(rms.mean.numpy(), everything.mean(0), rtol=1e-10)
    np.testing.assert_allclose(rms.var.numpy(), everything.var(0), rtol=1e-10)
    assert rms.count == len(everything)


# --- policies ---------------------------------------------------------------------------------------------------


def test_categorical_actor_matches_torch_distributions():
    torch.manual_seed(0)
    policy = ActorCritic(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(4))
    obs = torch.randn(6, 3)
    pd = policy.actor(obs)
    reference = torch.distributions.Categorical(logits=pd)
    actions = torch.tensor([0, 1, 2, 3, 0, 1])
    torch.testing.assert_close(policy.actor.log_prob(pd, actions), reference.log_prob(actions))
    torch.testing.assert_close(policy.actor.entropy(pd), reference.entropy())
    other = torch.distributions.Categorical(logits=torch.randn(6, 4))
    torch.testing.assert_close(policy.actor.kl(pd, other.logits), torch.distributions.kl_divergence(reference, other))
    # Inverse-CDF sampling on a fine grid of uniforms reproduces the probabilities.
    grid = (torch.arange(20_000) + 0.5) / 20_000
    samples = policy.actor.sample(pd[:1].expand(20_000, 4), grid)
    frequencies = torch.bincount(samples, minlength=4).float() / 20_000
    torch.testing.assert_close(frequencies, reference.probs[0], atol=1e-4, rtol=0)


def test_gaussian_actor_matches_torch_distributions():
    torch.manual_seed(0)
    policy = ActorCritic(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-2, 2, (2,)))
    with torch.no_grad():
        policy.actor.log_std.copy_(torch.tensor([-0.5, 0.3]))
    obs = torch.randn(5, 3)
    pd = policy.actor(obs)
    mean, log_std = pd.chunk(2, -1)
    reference = torch.distributions.Normal(mean, log_std.exp())
    actions = torch.randn(5, 2)
    torch.testing.assert_close(policy.actor.log_prob(pd, actions), reference.log_prob(actions).sum(-1))
    torch.testing.assert_close(policy.actor.entropy(pd), reference.entropy().sum(-1))
    other_mean, other_log_std = torch.randn(5, 2), torch.randn(5, 2) * 0.3
    other = torch.distributions.Normal(other_mean, other_log_std.exp())
    torch.testing.assert_close(
        policy.actor.kl(pd, torch.cat([other_mean, other_log_std], -1)),
        torch.distributions.kl_divergence(reference, other).sum(-1),
    )
    noise = torch.randn(5, 2)
    torch.testing.assert_close(policy.actor.sample(pd, noise), mean + log_std.exp() * noise)
    torch.testing.assert_close(policy.deterministic_action(obs), mean)


def test_unsupported_spaces_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="Discrete or a flat Box"):
        ActorCritic(gym.spaces.Box(-1, 1, (3,)), gym.spaces.MultiBinary(3))
    with pytest.raises(ValueError, match="flat Box observations"):
        ActorCritic(gym.spaces.Discrete(5), gym.spaces.Discrete(2))


# --- optimizer --------------------------------------------------------------------------------------------------


def test_flat_adam_equals_torch_adam_with_grad_clipping():
    torch.manual_seed(0)
    reference = ActorCritic(gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-1, 1, (2,)))
    model = copy.deepcopy(reference)
    torch_adam = torch.optim.Adam(reference.parameters(), lr=3e-3, eps=1e-5)
    flat_adam = FlatAdam(model.parameters(), lr=3e-3, eps=1e-5)
    for _ in range(30):
        obs, actions = torch.randn(16, 3), torch.randn(16, 2)
        for m, opt in ((reference, torch_adam), (model, flat_adam)):
            log_probs, entropy, values = m.evaluate(obs, actions)
            loss = -(log_probs.mean() + 0.01 * entropy.mean()) + values.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if opt is torch_adam:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            else:
                opt.clip_grad_norm(0.5)
            opt.step()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert next(model.parameters()).data_ptr() == flat_adam.flat.data_ptr()  # parameters live in the buffer


# --- config -----------------------------------------------------------------------------------------------------


def test_config_defaults_per_algorithm_and_validation_messages():
    assert quiet(algo="ppo").num_envs == 8 and quiet(algo="trpo").max_grad_norm is None
    assert quiet(algo="ppo", max_grad_norm=0).max_grad_norm is None
    with pytest.raises(ValueError, match="raise --steps"):
        quiet(algo="ppo", steps=100)
    with pytest.raises(ValueError, match="gae_lambda"):
        quiet(gae_lambda=1.5)
    with pytest.raises(ValueError, match="algo must be one of"):
        quiet(algo="a2c")
    with pytest.raises(ValueError, match="max_kl"):
        quiet(algo="trpo", max_kl=0.0)
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        DataParallel(ParallelDims(dp_replicate=3, world_size=3)).shard(4)


def test_config_becomes_command_line_options():
    import argparse

    from spinwheel.config import add_arguments, from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser, ClassicConfig)
    ns = parser.parse_args(
        [
            "--algo",
            "trpo",
            "--env",
            "Pendulum-v1",
            "--steps",
            "5000",
            "--seed",
            "3",
            "--num-envs",
            "2",
            "--hidden-sizes",
            "32",
            "32",
            "--no-line-search",
        ]
    )
    config = from_args(ClassicConfig, ns)
    assert (config.algo, config.env, config.steps, config.seed, config.num_envs) == ("trpo", "Pendulum-v1", 5000, 3, 2)
    assert config.hidden_sizes == (32, 32) and config.line_search is False and config.num_steps == 512


# --- training end to end ----------------------------------------------------------------------------------------


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_writes_outputs_and_is_reproducible(tmp_path):
    kwargs = dict(
        algo="ppo",
        env="Pendulum-v1",
        steps=512,
        num_envs=2,
        num_steps=128,
        minibatch_size=64,
        update_epochs=2,
        normalize_obs=True,
        normalize_reward=True,
        eval_episodes=2,
    )
    first = train(quiet(out_dir=str(tmp_path / "a"), **kwargs))
    second = train(quiet(out_dir=str(tmp_path / "b"), **kwargs))
    assert first["eval_returns"] == second["eval_returns"] and len(first["eval_returns"]) == 2
    assert math.isfinite(first["eval_return_mean"]) and first["env_steps"] == 512
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    drop = {"time_s", "env_steps_per_s"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in a[:-1]] == [
        {k: v for k, v in r.items() if k not in drop} for r in b[:-1]
    ]
    assert {"approx_kl", "clip_frac", "explained_variance", "episode_return_mean"} <= set(a[0])
    assert a[-1]["eval"]["eval_return_mean"] == first["eval_return_mean"]
    assert (tmp_path / "a" / "learning_curve.png").stat().st_size > 1000
    policy, obs_rms, config = load_policy(tmp_path / "a" / "policy.pt")
    assert config.env == "Pendulum-v1" and obs_rms is not None and obs_rms.count > 0
    returns = evaluate_policy(
        policy, "Pendulum-v1", 2, seed=config.seed + 1_000_000, obs_rms=obs_rms, clip_obs=config.clip_obs
    )
    # Not bit-equal: the trained weights were views into one flat buffer, and BLAS kernels may round
    # differently for differently aligned memory.
    assert returns == pytest.approx(first["eval_returns"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo,kwargs,steps",
    [
        ("ppo", PPO_CARTPOLE, 25_000),
        ("trpo", dict(num_envs=4, num_steps=256, max_kl=0.03), 20_000),
        ("vpg", dict(num_envs=4, num_steps=128, lr=1e-2), 30_000),
    ],
)
def test_learns_cartpole(tmp_path, algo, kwargs, steps):
    result = train(
        quiet(algo=algo, env="CartPole-v1", steps=steps, seed=0, eval_episodes=5, out_dir=str(tmp_path), **kwargs)
    )
    first_returns = [r["episode_return_mean"] for r in read_metrics(tmp_path)[:3] if r.get("episode_return_mean")]
    assert np.mean(first_returns) < 40  # a random CartPole policy lasts ~20 steps
    assert result["eval_return_mean"] >= 150, result


# --- data parallel ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DP_CONFIGS = [
    # small minibatches so the ranks' shares of a minibatch differ (and are sometimes empty)
    dict(
        algo="ppo",
        env="CartPole-v1",
        steps=4 * 16 * 3,
        num_envs=4,
        num_steps=16,
        minibatch_size=6,
        update_epochs=2,
        normalize_obs=True,
        normalize_reward=True,
        target_kl=0.02,
        ent_coef=0.01,
    ),
    dict(
        algo="trpo",
        env="Pendulum-v1",
        steps=4 * 32 * 2,
        num_envs=4,
        num_steps=32,
        minibatch_size=16,
        update_epochs=2,
        normalize_obs=True,
    ),
    dict(algo="vpg", env="CartPole-v1", steps=4 * 32 * 2, num_envs=4, num_steps=32, minibatch_size=32, update_epochs=1),
]


def dp_worker(rank: int, world_size: int, ports: list[int], out_root: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    for i, (kwargs, port) in enumerate(zip(DP_CONFIGS, ports)):
        os.environ["MASTER_PORT"] = str(port)
        train(quiet(out_dir=os.path.join(out_root, f"dp{i}"), eval_episodes=0, dist_timeout_s=60, **kwargs))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
def test_data_parallel_equals_single_process(tmp_path):
    ctx = rank_context()  # ranks forked from a server that imported torch once, as spawn() starts them
    ports = [free_port() for _ in DP_CONFIGS]
    procs = [ctx.Process(target=dp_worker, args=(rank, 2, ports, str(tmp_path))) for rank in range(2)]
    for p in procs:
        p.start()
    for kwargs in DP_CONFIGS:  # the single-process runs, meanwhile
        i = DP_CONFIGS.index(kwargs)
        train(quiet(out_dir=str(tmp_path / f"single{i}"), eval_episodes=0, **kwargs))
    for p in procs:
        p.join(timeout=150)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "data-parallel ranks hung"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

    for i, kwargs in enumerate(DP_CONFIGS):
        single = torch.load(tmp_path / f"single{i}" / "policy.pt", weights_only=False)
        parallel = torch.load(tmp_path / f"dp{i}" / "policy.pt", weights_only=False)
        for name, value in single["state_dict"].items():
            torch.testing.assert_close(
                parallel["state_dict"][name], value, rtol=1e-5, atol=1e-5, msg=f"{kwargs['algo']}: {name}"
            )
        if single["obs_rms"] is not None:
            torch.testing.assert_close(parallel["obs_rms"]["mean"], single["obs_rms"]["mean"], rtol=1e-4, atol=1e-5)
        drop = {"time_s", "env_steps_per_s"}
        for a, b in zip(read_metrics(tmp_path / f"single{i}")[:-1], read_metrics(tmp_path / f"dp{i}")[:-1]):
            for key, value in a.items():
                if key not in drop and isinstance(value, float) and math.isfinite(value):
                    assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (kwargs["algo"], key)
