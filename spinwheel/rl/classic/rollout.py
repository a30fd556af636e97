"""Rollout collection: step the environments with the current policy, fill the buffer, update the statistics.

Under data parallelism each rank steps its block of the environments (``dp.shard``). Action noise is drawn for
all environments of all ranks from one seeded generator and each rank keeps its slice, so a data-parallel run
samples the actions of a one-process run. Observation and reward statistics are summed over ranks once per
rollout and change only between rollouts (see ``envs.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from spinwheel.rl.classic.buffer import Batch, RolloutBuffer
from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.envs import RewardScaler, RunningMeanStd, VecEnv
from spinwheel.rl.classic.policies import ActorCritic


def obs_tensor(obs: np.ndarray, obs_rms: RunningMeanStd | None, clip: float) -> torch.Tensor:
    """``(N, obs_dim)`` observations as a tensor, normalised by the running statistics when there are any."""
    x = torch.from_numpy(obs)
    return x if obs_rms is None else obs_rms.normalize(x, clip)


class RolloutCollector:
    """Steps the environments with the current policy and fills the buffer (one per training run)."""

    def __init__(self, config: ClassicConfig, dp: DataParallel, envs: VecEnv, policy: ActorCritic):
        self.config, self.dp, self.envs, self.policy = config, dp, envs, policy
        space = envs.single_action_space
        discrete = policy.discrete
        self.buffer = RolloutBuffer(
            config.num_steps,
            envs.num_envs,
            envs.single_observation_space.shape,
            () if discrete else space.shape,
            torch.int64 if discrete else torch.float32,
        )
        self.obs_rms = RunningMeanStd(envs.single_observation_space.shape) if config.normalize_obs else None
        self.reward_scaler = (
            RewardScaler(envs.num_envs, config.gamma, config.clip_reward) if config.normalize_reward else None
        )
        self.noise_shape = policy.actor.noise_shape(config.num_envs)  # noise for all envs of all ranks
        self.env_slice = dp.shard(config.num_envs)
        self.generator = torch.Generator().manual_seed(config.seed + 1)
        # The first rollout sees raw observations (mean 0, var 1); statistics from a handful of reset states
        # would have near-zero variance and blow the inputs up to the clip value.
        self.raw_obs = envs.reset()

    def collect(self) -> tuple[Batch, list[float], list[int]]:
        cfg, buffer, policy = self.config, self.buffer, self.policy
        returns: list[float] = []
        lengths: list[int] = []
        raw_obs_seen, discounted_seen = [], []
        obs = obs_tensor(self.raw_obs, self.obs_rms, cfg.clip_obs)
        # Sampling noise of the whole rollout for all environments of all ranks; this rank keeps its slice.
        draw = torch.rand if policy.discrete else torch.randn
        noise = draw((cfg.num_steps, *self.noise_shape), generator=self.generator)[:, self.env_slice]
        for t in range(cfg.num_steps):
            actions, log_probs, values = policy.act(obs, noise[t])
            step = self.envs.step(actions.numpy())
            rewards = step.rewards
            if self.reward_scaler is not None:
                rewards, seen = self.reward_scaler(rewards, step.terminated | step.truncated)
                discounted_seen.append(seen)
            bootstrap = None
            if step.truncated.any():
                with torch.no_grad():
                    bootstrap = torch.zeros(self.envs.num_envs)
                    final = obs_tensor(step.final_obs[step.truncated], self.obs_rms, cfg.clip_obs)
                    bootstrap[torch.from_numpy(step.truncated)] = policy.value(final)
            buffer.add(t, obs, actions, log_probs, values, rewards, step.terminated, step.truncated, bootstrap)
            if self.obs_rms is not None:
                raw_obs_seen.append(step.obs)
            self.raw_obs = step.obs
            obs = obs_tensor(step.obs, self.obs_rms, cfg.clip_obs)
            returns += step.episode_returns
            lengths += step.episode_lengths
        with torch.no_grad():
            last_values = policy.value(obs)
        batch = buffer.finish(last_values, cfg.gamma, cfg.gae_lambda, with_rewards_to_go=cfg.algo != "ppo")
        # Statistics change between rollouts only, identically on every rank.
        if self.obs_rms is not None:
            seen_obs = torch.from_numpy(np.stack(raw_obs_seen).reshape(-1, obs.shape[-1]))
            self.obs_rms.update_from_sums(self.dp.sum(RunningMeanStd.sums(seen_obs)))
        if self.reward_scaler is not None:
            seen = torch.from_numpy(np.stack(discounted_seen).reshape(-1))
            self.reward_scaler.rms.update_from_sums(self.dp.sum(RunningMeanStd.sums(seen)))
        return batch, returns, lengths
