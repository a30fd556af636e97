"""Vectorised gymnasium environments and running mean/std normalisation of observations and rewards.

References: gymnasium's ``SyncVectorEnv`` with same-step autoreset (the final observation of an episode cut
by a time limit is kept for bootstrapping); Chan, Golub & LeVeque (1979) for combining batch moments; the
``VecNormalize`` scheme of Stable-Baselines3 for scaling rewards by the std of the discounted return.

Normalisation statistics are updated once per rollout from the whole rollout's data (summed over
data-parallel ranks by the trainer) and frozen during it, so every sample of a rollout is normalised the
same way and every rank uses the same statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor

MUJOCO_INSTALL = 'pip install -e ".[mujoco]"'


def make_env(env_id: str) -> gym.Env:
    """``gym.make(env_id)``, with gymnasium's registry and dependency errors turned into a ``ValueError`` whose
    one-line message names the fix (the command prints it instead of a traceback)."""
    try:
        return gym.make(env_id)
    except gym.error.DependencyNotInstalled as e:
        if "mujoco" in str(e).lower():
            raise ValueError(f"{env_id} needs MuJoCo, which is not installed; run {MUJOCO_INSTALL}") from e
        raise ValueError(f"{env_id} needs a package that is not installed: {e}") from e
    except gym.error.Error as e:
        raise ValueError(
            f"unknown gymnasium environment {env_id!r}: {e} (list the ids with "
            "python -c 'import gymnasium; gymnasium.pprint_registry()')"
        ) from e
    except ImportError as e:  # a module the environment imports itself, e.g. imageio beside a bare `pip install mujoco`
        missing = e.name or str(e)
        if _is_mujoco(env_id):
            raise ValueError(
                f"{env_id} needs the MuJoCo extra ({missing} is not installed); run {MUJOCO_INSTALL}"
            ) from e
        raise ValueError(f"{env_id} needs a package that is not installed: {missing} ({e})") from e


def _is_mujoco(env_id: str) -> bool:
    """Whether gymnasium registers ``env_id`` as one of its MuJoCo environments."""
    try:
        entry_point = gym.spec(env_id).entry_point
    except gym.error.Error:
        return False
    return isinstance(entry_point, str) and entry_point.startswith("gymnasium.envs.mujoco")


class RunningMeanStd:
    """Mean and variance of a stream of batches, in float64: ``update`` with ``(B, *shape)`` batches."""

    def __init__(self, shape: tuple[int, ...] = ()):
        self.mean = torch.zeros(shape, dtype=torch.float64)
        self.var = torch.ones(shape, dtype=torch.float64)
        self.count = 0.0

    @staticmethod
    def sums(x: Tensor) -> Tensor:
        """``[count, Σx, Σx²]`` of a batch, stacked as ``(3, *shape)`` float64 so ranks can add them up."""
        x = x.to(torch.float64)
        return torch.stack([torch.full_like(x[0], x.shape[0]), x.sum(0), x.pow(2).sum(0)])

    def update_from_sums(self, sums: Tensor) -> None:
        """Merge a batch given by :meth:`sums` (parallel-variance formula of Chan et al.)."""
        n = sums[0].flatten()[0].item()
        if n == 0:
            return
        batch_mean = sums[1] / n
        batch_var = (sums[2] / n - batch_mean.pow(2)).clamp(min=0.0)
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta.pow(2) * self.count * n / total
        self.mean = self.mean + delta * n / total
        self.var = m2 / total
        self.count = total

    def update(self, x: Tensor) -> None:
        self.update_from_sums(self.sums(x))

    def normalize(self, x: Tensor, clip: float | None = None, eps: float = 1e-8) -> Tensor:
        out = ((x - self.mean) / torch.sqrt(self.var + eps)).to(x.dtype)
        return out if clip is None else out.clamp(-clip, clip)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], float(state["count"])


class RewardScaler:
    """Divide rewards by the running std of each environment's discounted return (not centred), then clip."""

    def __init__(self, num_envs: int, gamma: float, clip: float = 10.0):
        self.gamma, self.clip = gamma, clip
        self.returns = np.zeros(num_envs)
        self.rms = RunningMeanStd()

    def __call__(self, rewards: np.ndarray, dones: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scaled rewards and the discounted returns seen this step (to update the statistics with)."""
        self.returns = self.returns * self.gamma + rewards
        seen = self.returns.copy()
        self.returns[dones] = 0.0
        scaled = np.clip(rewards / np.sqrt(self.rms.var.item() + 1e-8), -self.clip, self.clip)
        return scaled, seen


@dataclass
class StepResult:
    """One step of ``N`` environments. ``final_obs[i]`` is the last observation of an episode that ended at
    this step (otherwise equal to ``obs[i]``, which then already belongs to the next episode)."""

    obs: np.ndarray  # (N, obs_dim) float32
    rewards: np.ndarray  # (N,) float64
    terminated: np.ndarray  # (N,) bool
    truncated: np.ndarray  # (N,) bool, False where terminated
    final_obs: np.ndarray  # (N, obs_dim) float32
    episode_returns: list[float] = field(default_factory=list)  # undiscounted, raw rewards
    episode_lengths: list[int] = field(default_factory=list)


class VecEnv:
    """``N`` copies of one gymnasium environment stepped in turn in this process, each reset as soon as its
    episode ends (the "same-step" autoreset of gymnasium's ``SyncVectorEnv``, whose per-step bookkeeping of
    info dicts costs more than the loop itself for cheap environments like CartPole).

    Environment ``i`` of this process is the global environment ``env_offset + i`` and is seeded
    ``seed + env_offset + i``, so a data-parallel run holds exactly the environments of a one-process run.
    """

    def __init__(self, env_id: str, num_envs: int, seed: int, env_offset: int = 0):
        self.num_envs = num_envs
        self.envs = [make_env(env_id) for _ in range(num_envs)]
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self._seeds = [seed + env_offset + i for i in range(num_envs)]
        self._box = isinstance(self.single_action_space, gym.spaces.Box)
        self._obs = np.zeros((num_envs, *self.single_observation_space.shape), dtype=np.float32)
        self._returns = np.zeros(num_envs)
        self._lengths = np.zeros(num_envs, dtype=np.int64)

    def reset(self) -> np.ndarray:
        for i, env in enumerate(self.envs):
            self._obs[i], _ = env.reset(seed=self._seeds[i])
        self._returns[:] = 0.0
        self._lengths[:] = 0
        return self._obs.copy()

    def step(self, actions: np.ndarray) -> StepResult:
        if self._box:
            actions = np.clip(actions, self.single_action_space.low, self.single_action_space.high)
        n = self.num_envs
        obs = np.empty_like(self._obs)
        rewards = np.empty(n)
        terminated = np.zeros(n, dtype=bool)
        truncated = np.zeros(n, dtype=bool)
        result = StepResult(obs, rewards, terminated, truncated, obs)
        finals = {}
        for i, env in enumerate(self.envs):
            obs[i], rewards[i], terminated[i], truncated[i], _ = env.step(actions[i])
            if terminated[i] or truncated[i]:
                finals[i] = obs[i].copy()
                result.episode_returns.append(float(self._returns[i] + rewards[i]))
                result.episode_lengths.append(int(self._lengths[i] + 1))
                self._returns[i] = -rewards[i]  # the += below brings the new episode to 0
                self._lengths[i] = -1
                obs[i], _ = env.reset()
        if finals:
            result.final_obs = obs.copy()
            for i, final in finals.items():
                result.final_obs[i] = final
        truncated &= ~terminated
        self._returns += rewards
        self._lengths += 1
        self._obs = obs
        return result

    def close(self) -> None:
        for env in self.envs:
            env.close()


def evaluate_policy(
    policy,
    env_id: str,
    num_episodes: int,
    seed: int,
    obs_rms: RunningMeanStd | None = None,
    clip_obs: float | None = None,
) -> list[float]:
    """Undiscounted returns of ``num_episodes`` episodes with the deterministic action (argmax / mean).

    Episode ``k`` starts from ``reset(seed=seed + k)``; the observation statistics are frozen.
    """
    env = make_env(env_id)
    box = isinstance(env.action_space, gym.spaces.Box)
    returns = []
    for k in range(num_episodes):
        obs, _ = env.reset(seed=seed + k)
        total, done = 0.0, False
        while not done:
            x = torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0)
            if obs_rms is not None:
                x = obs_rms.normalize(x, clip_obs)
            action = policy.deterministic_action(x)[0].numpy()
            if box:
                action = np.clip(action, env.action_space.low, env.action_space.high)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return returns
