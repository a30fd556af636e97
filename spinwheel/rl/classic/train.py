"""Classic-control training: config, rollout → update loop, evaluation, metrics, learning curve, saved policy.

One loop serves VPG, TRPO and PPO: collect ``num_steps`` steps from ``num_envs`` environments, compute
GAE-λ advantages and value targets, hand the batch to the algorithm's ``update``. Under ``torchrun`` each rank
steps its block of the environments and the updates sum gradients over ranks (``distributed.py``); rank 0
writes the outputs. With a fixed seed a run is reproducible, and a data-parallel run takes the same steps as
a one-process run with the same ``num_envs``.

Outputs in ``out_dir``: ``metrics.jsonl`` (one line per update, then an ``eval`` line), ``learning_curve.png``,
``policy.pt`` (state dict, observation statistics and config; see :func:`load_policy`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from spinwheel.config import option
from spinwheel.rl.classic.buffer import Batch, RolloutBuffer
from spinwheel.rl.classic.distributed import DataParallel
from spinwheel.rl.classic.envs import RewardScaler, RunningMeanStd, VecEnv, evaluate_policy
from spinwheel.rl.classic.policies import ActorCritic
from spinwheel.rl.classic.ppo import PPO
from spinwheel.rl.classic.trpo import TRPO
from spinwheel.rl.classic.vpg import VPG

# Per-algorithm defaults for the fields left at None.
_DEFAULTS: dict[str, dict[str, object]] = {
    "ppo": dict(num_envs=8, num_steps=256, lr=3e-4, gae_lambda=0.95, minibatch_size=64, update_epochs=10,
                anneal_lr=True, max_grad_norm=0.5),
    "trpo": dict(num_envs=4, num_steps=512, lr=0.0, gae_lambda=0.97, minibatch_size=128, update_epochs=10,
                 anneal_lr=False, max_grad_norm=None),
    "vpg": dict(num_envs=4, num_steps=256, lr=3e-3, gae_lambda=0.97, minibatch_size=256, update_epochs=10,
                anneal_lr=False, max_grad_norm=None),
}


@dataclass
class ClassicConfig:
    """Policy-gradient RL (VPG / TRPO / PPO) on a gymnasium environment."""

    algo: Literal["vpg", "trpo", "ppo"] = option("ppo", help="algorithm")
    env: str = option("CartPole-v1", help="gymnasium environment id (flat Box observations)")
    steps: int = option(100_000, help="total environment steps (all environments, all ranks)")
    seed: int = option(0, help="seed of weights, environments, action sampling and minibatch order")
    num_envs: int | None = option(None, help="environments in total, split over ranks (ppo 8, trpo 4, vpg 4)")
    num_steps: int | None = option(None, help="rollout length per environment per update (ppo 256, trpo 512, "
                                               "vpg 256)")
    gamma: float = option(0.99, help="discount factor")
    gae_lambda: float | None = option(None, help="GAE λ (ppo 0.95, trpo/vpg 0.97)")
    hidden_sizes: tuple[int, ...] = option((64, 64), help="hidden layer widths of the actor and of the critic")
    activation: Literal["tanh", "relu"] = option("tanh", help="hidden activation")
    lr: float | None = option(None, help="Adam learning rate: ppo actor+critic (3e-4), vpg actor (3e-3); "
                                         "unused by trpo")
    vf_lr: float = option(1e-3, help="vpg/trpo critic Adam learning rate")
    anneal_lr: bool | None = option(None, help="decay learning rates linearly to 0 (default: on for ppo)")
    update_epochs: int | None = option(None, help="ppo: epochs over each rollout; vpg/trpo: critic epochs (10)")
    minibatch_size: int | None = option(None, help="samples per minibatch (ppo 64, trpo 128, vpg 256)")
    norm_adv: bool = option(True, help="normalise advantages (per minibatch for ppo, per rollout otherwise)")
    max_grad_norm: float | None = option(None, help="clip the global gradient norm (ppo 0.5, else off; 0 turns it off)")
    clip_range: float = option(0.2, help="ppo: ratio clip ε")
    clip_range_vf: float | None = option(None, help="ppo: clip value predictions to ±this around old values")
    ent_coef: float = option(0.0, help="ppo: entropy bonus coefficient")
    vf_coef: float = option(0.5, help="ppo: value loss coefficient")
    target_kl: float | None = option(None, help="ppo: stop the update when approx-KL exceeds 1.5 × this")
    max_kl: float = option(0.01, help="trpo: KL radius δ")
    cg_iters: int = option(10, help="trpo: conjugate-gradient iterations")
    cg_damping: float = option(0.1, help="trpo: damping added to the Fisher matrix")
    line_search: bool = option(True, help="trpo: backtracking line search (off: natural policy gradient)")
    backtrack_iters: int = option(10, help="trpo: line-search steps")
    backtrack_coef: float = option(0.8, help="trpo: line-search shrink factor")
    normalize_obs: bool = option(False, help="normalise observations by running mean/std")
    normalize_reward: bool = option(False, help="scale rewards by the running std of the discounted return")
    clip_obs: float = option(10.0, help="clip normalised observations to ±this")
    clip_reward: float = option(10.0, help="clip scaled rewards to ±this (with --normalize-reward)")
    eval_episodes: int = option(10, help="deterministic evaluation episodes at the end")
    out_dir: str = option("runs/classic", help="where metrics.jsonl, learning_curve.png and policy.pt go")
    progress: bool = option(True, help="show a progress bar")
    num_threads: int = option(1, help="torch CPU threads (1 is fastest for small MLPs)")
    dist_timeout_s: float = option(300.0, help="timeout of data-parallel collectives, seconds")

    def __post_init__(self) -> None:
        if self.algo not in _DEFAULTS:
            raise ValueError(f"algo must be one of {sorted(_DEFAULTS)}, got {self.algo!r}")
        for name, value in _DEFAULTS[self.algo].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            self.max_grad_norm = None
        self.hidden_sizes = tuple(self.hidden_sizes)
        checks = [
            (self.num_envs >= 1, f"num_envs must be ≥ 1, got {self.num_envs}"),
            (self.num_steps >= 1, f"num_steps must be ≥ 1, got {self.num_steps}"),
            (self.steps >= self.num_envs * self.num_steps,
             f"steps ({self.steps}) is less than one rollout (num_envs × num_steps = "
             f"{self.num_envs * self.num_steps}); raise --steps or lower --num-steps / --num-envs"),
            (0.0 < self.gamma <= 1.0, f"gamma must be in (0, 1], got {self.gamma}"),
            (0.0 <= self.gae_lambda <= 1.0, f"gae_lambda must be in [0, 1], got {self.gae_lambda}"),
            (len(self.hidden_sizes) > 0 and all(h > 0 for h in self.hidden_sizes),
             f"hidden_sizes must be positive widths, got {self.hidden_sizes}"),
            (self.minibatch_size >= 1, f"minibatch_size must be ≥ 1, got {self.minibatch_size}"),
            (self.update_epochs >= 0, f"update_epochs must be ≥ 0, got {self.update_epochs}"),
            (self.algo != "ppo" or self.update_epochs >= 1, "ppo needs update_epochs ≥ 1"),
            (self.algo == "trpo" or self.lr > 0, f"lr must be > 0 for {self.algo}, got {self.lr}"),
            (self.vf_lr > 0, f"vf_lr must be > 0, got {self.vf_lr}"),
            (self.clip_range > 0, f"clip_range must be > 0, got {self.clip_range}"),
            (self.clip_range_vf is None or self.clip_range_vf > 0, "clip_range_vf must be > 0 or None"),
            (self.target_kl is None or self.target_kl > 0, "target_kl must be > 0 or None"),
            (self.max_kl > 0, f"max_kl (δ) must be > 0, got {self.max_kl}"),
            (self.cg_iters >= 1, f"cg_iters must be ≥ 1, got {self.cg_iters}"),
            (self.cg_damping >= 0, f"cg_damping must be ≥ 0, got {self.cg_damping}"),
            (0 < self.backtrack_coef < 1, f"backtrack_coef must be in (0, 1), got {self.backtrack_coef}"),
            (self.backtrack_iters >= 1, f"backtrack_iters must be ≥ 1, got {self.backtrack_iters}"),
            (self.clip_obs > 0 and self.clip_reward > 0, "clip_obs and clip_reward must be > 0"),
            (self.eval_episodes >= 0, f"eval_episodes must be ≥ 0, got {self.eval_episodes}"),
            (self.num_threads >= 1, f"num_threads must be ≥ 1, got {self.num_threads}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def rollout_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        return self.steps // self.rollout_size


_ALGORITHMS = {"ppo": PPO, "trpo": TRPO, "vpg": VPG}


def _obs_tensor(obs: np.ndarray, obs_rms: RunningMeanStd | None, clip: float) -> torch.Tensor:
    x = torch.from_numpy(obs)
    return x if obs_rms is None else obs_rms.normalize(x, clip)


class _Rollout:
    """Steps the environments with the current policy and fills the buffer (one per training run)."""

    def __init__(self, config: ClassicConfig, dp: DataParallel, envs: VecEnv, policy: ActorCritic):
        self.config, self.dp, self.envs, self.policy = config, dp, envs, policy
        space = envs.single_action_space
        discrete = policy.discrete
        self.buffer = RolloutBuffer(config.num_steps, envs.num_envs, envs.single_observation_space.shape,
                                    () if discrete else space.shape, torch.int64 if discrete else torch.float32)
        self.obs_rms = RunningMeanStd(envs.single_observation_space.shape) if config.normalize_obs else None
        self.reward_scaler = (RewardScaler(envs.num_envs, config.gamma, config.clip_reward)
                              if config.normalize_reward else None)
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
        obs = _obs_tensor(self.raw_obs, self.obs_rms, cfg.clip_obs)
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
                    final = _obs_tensor(step.final_obs[step.truncated], self.obs_rms, cfg.clip_obs)
                    bootstrap[torch.from_numpy(step.truncated)] = policy.value(final)
            buffer.add(t, obs, actions, log_probs, values, rewards, step.terminated, step.truncated, bootstrap)
            if self.obs_rms is not None:
                raw_obs_seen.append(step.obs)
            self.raw_obs = step.obs
            obs = _obs_tensor(step.obs, self.obs_rms, cfg.clip_obs)
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


def _explained_variance(batch: Batch, dp: DataParallel) -> float:
    _, std_target = dp.mean_std(batch.returns)
    _, std_error = dp.mean_std(batch.returns - batch.values)
    if std_target.item() == 0:
        return float("nan")
    return 1.0 - (std_error / std_target).pow(2).item()


def train(config: ClassicConfig) -> dict:
    """Train, evaluate deterministically, save; returns the final figures (``eval_return_mean`` …).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calls this; rank 0 writes the outputs.
    """
    dp = DataParallel.from_torchrun_env(config.dist_timeout_s)
    try:
        return _train(config, dp)
    finally:
        dp.close()


def _train(config: ClassicConfig, dp: DataParallel) -> dict:
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    env_slice = dp.shard(config.num_envs)
    envs = VecEnv(config.env, env_slice.stop - env_slice.start, config.seed, env_offset=env_slice.start)
    policy = ActorCritic(envs.single_observation_space, envs.single_action_space, config.hidden_sizes,
                         config.activation)
    algorithm = _ALGORITHMS[config.algo](policy, config, dp)
    rollout = _Rollout(config, dp, envs, policy)
    shuffle_generator = torch.Generator().manual_seed(config.seed + 2)

    out_dir = Path(config.out_dir)
    metrics_file = None
    if dp.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = open(out_dir / "metrics.jsonl", "w")
    history: list[dict] = []
    bar = tqdm(total=config.num_updates * config.rollout_size, unit="step", dynamic_ncols=True,
               disable=not (config.progress and dp.is_main), desc=f"{config.algo} {config.env}")
    start, start_cpu = time.perf_counter(), time.process_time()
    env_steps = 0
    try:
        for update in range(config.num_updates):
            batch, returns, lengths = rollout.collect()
            lr_scale = 1.0 - update / config.num_updates if config.anneal_lr else 1.0
            stats = algorithm.update(batch, config.num_envs, shuffle_generator, lr_scale)
            env_steps += config.rollout_size
            episodes = dp.sum(torch.tensor([sum(returns), float(len(returns)), float(sum(lengths))],
                                           dtype=torch.float64))
            elapsed = time.perf_counter() - start
            record = {
                "update": update + 1, "env_steps": env_steps, "time_s": round(elapsed, 3),
                "env_steps_per_s": env_steps / elapsed,
                "episodes": int(episodes[1].item()),
                "episode_return_mean": (episodes[0] / episodes[1]).item() if episodes[1] > 0 else None,
                "episode_length_mean": (episodes[2] / episodes[1]).item() if episodes[1] > 0 else None,
                "explained_variance": _explained_variance(batch, dp), "lr_scale": lr_scale, **stats,
            }
            history.append(record)
            if metrics_file is not None:
                metrics_file.write(json.dumps(record) + "\n")
            bar.update(config.rollout_size)
            if record["episode_return_mean"] is not None:
                bar.set_postfix(ret=f"{record['episode_return_mean']:.1f}", refresh=False)
        bar.close()
        train_seconds = time.perf_counter() - start
        train_cpu_seconds = time.process_time() - start_cpu

        result = {"algo": config.algo, "env": config.env, "seed": config.seed, "env_steps": env_steps,
                  "train_seconds": train_seconds, "train_cpu_seconds": train_cpu_seconds,
                  "env_steps_per_s": env_steps / max(train_seconds, 1e-9), "world_size": dp.world_size}
        eval_figures = torch.full((2,), float("nan"), dtype=torch.float64)
        if dp.is_main:
            eval_returns = evaluate_policy(policy, config.env, config.eval_episodes, seed=config.seed + 1_000_000,
                                           obs_rms=rollout.obs_rms,
                                           clip_obs=config.clip_obs if config.normalize_obs else None)
            if eval_returns:
                eval_figures = torch.tensor([np.mean(eval_returns), np.std(eval_returns)], dtype=torch.float64)
            result["eval_returns"] = eval_returns
        eval_figures = dp.broadcast(eval_figures)
        result["eval_return_mean"], result["eval_return_std"] = eval_figures.tolist()
        if dp.is_main:
            assert metrics_file is not None
            metrics_file.write(json.dumps({"eval": result}) + "\n")
            save_policy(policy, rollout.obs_rms, config, out_dir / "policy.pt")
            plot_learning_curve(history, out_dir / "learning_curve.png",
                                title=f"{config.algo} {config.env} seed {config.seed}",
                                final=(result["eval_return_mean"], result["eval_return_std"]))
            result["out_dir"] = str(out_dir)
        return result
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
        envs.close()


def save_policy(policy: ActorCritic, obs_rms: RunningMeanStd | None, config: ClassicConfig, path: Path) -> None:
    torch.save({"state_dict": policy.state_dict(), "obs_rms": None if obs_rms is None else obs_rms.state_dict(),
                "config": dataclasses.asdict(config)}, path)


def load_policy(path: str | Path) -> tuple[ActorCritic, RunningMeanStd | None, ClassicConfig]:
    """Rebuild the policy saved by :func:`train` (with its observation statistics and config)."""
    import gymnasium as gym

    saved = torch.load(path, weights_only=False)
    config = ClassicConfig(**saved["config"])
    env = gym.make(config.env)
    policy = ActorCritic(env.observation_space, env.action_space, config.hidden_sizes, config.activation)
    env.close()
    policy.load_state_dict(saved["state_dict"])
    obs_rms = None
    if saved["obs_rms"] is not None:
        obs_rms = RunningMeanStd()
        obs_rms.load_state_dict(saved["obs_rms"])
    return policy, obs_rms, config


def plot_learning_curve(history: list[dict], path: Path, title: str, final: tuple[float, float] | None = None) -> None:
    """Mean training-episode return per update against environment steps (Agg canvas, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = [(h["env_steps"], h["episode_return_mean"]) for h in history if h["episode_return_mean"] is not None]
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, label="training episodes")
    if final is not None and history and not math.isnan(final[0]):
        ax.errorbar([history[-1]["env_steps"]], [final[0]], yerr=[final[1]], fmt="o", capsize=4,
                    label="deterministic eval")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
