"""What a run leaves behind: ``policy.pt`` (weights, observation statistics, config) and ``learning_curve.png``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.envs import RunningMeanStd
from spinwheel.rl.classic.policies import ActorCritic


def save_policy(policy: ActorCritic, obs_rms: RunningMeanStd | None, config: ClassicConfig, path: Path) -> None:
    torch.save({"state_dict": policy.state_dict(), "obs_rms": None if obs_rms is None else obs_rms.state_dict(),
                "config": dataclasses.asdict(config)}, path)


def load_policy(path: str | Path) -> tuple[ActorCritic, RunningMeanStd | None, ClassicConfig]:
    """Rebuild the policy saved by :func:`~spinwheel.rl.classic.loop.train`, its observation statistics and config."""
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
