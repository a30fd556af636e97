"""What a run leaves behind: ``policy.pt`` (weights, observation statistics, config) and ``learning_curve.png``."""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.envs import RunningMeanStd, evaluate_policy, make_env
from spinwheel.rl.classic.policies import ActorCritic


def save_policy(policy: ActorCritic, obs_rms: RunningMeanStd | None, config: ClassicConfig, path: Path) -> None:
    """Write ``policy.pt`` through a temporary file, so an interrupted save never leaves half a file behind."""
    partial = path.with_name(path.name + ".partial")
    torch.save(
        {
            "state_dict": policy.state_dict(),
            "obs_rms": None if obs_rms is None else obs_rms.state_dict(),
            "config": dataclasses.asdict(config),
        },
        partial,
    )
    os.replace(partial, path)


def load_policy(path: str | Path) -> tuple[ActorCritic, RunningMeanStd | None, ClassicConfig]:
    """Rebuild the policy saved by :func:`~spinwheel.rl.classic.loop.train`, its observation statistics and config.

    A file that is not such a ``policy.pt`` raises ``ValueError`` saying so; a missing one ``FileNotFoundError``.
    """
    try:
        saved = torch.load(path, weights_only=False)
        config = ClassicConfig(**saved["config"])
        state_dict = saved["state_dict"]
    except FileNotFoundError:
        raise
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a policy.pt written by spinwheel classic ({type(e).__name__}: {e})") from e
    env = make_env(config.env)
    policy = ActorCritic(env.observation_space, env.action_space, config.hidden_sizes, config.activation)
    env.close()
    policy.load_state_dict(state_dict)
    obs_rms = None
    if saved["obs_rms"] is not None:
        obs_rms = RunningMeanStd()
        obs_rms.load_state_dict(saved["obs_rms"])
    return policy, obs_rms, config


def evaluate_saved(path: str | Path, num_episodes: int) -> dict:
    """Deterministic returns of a saved ``policy.pt`` on the run's own evaluation episodes (seeds
    ``seed + 1_000_000 + k``), so a finished run reproduces the figure it reported."""
    policy, obs_rms, config = load_policy(path)
    returns = evaluate_policy(
        policy,
        config.env,
        num_episodes,
        seed=config.seed + 1_000_000,
        obs_rms=obs_rms,
        clip_obs=config.clip_obs if obs_rms is not None else None,
    )
    return {
        "env": config.env,
        "algo": config.algo,
        "eval_returns": returns,
        "eval_return_mean": float(np.mean(returns)) if returns else float("nan"),
        "eval_return_std": float(np.std(returns)) if returns else float("nan"),
    }


def plot_learning_curve(history: list[dict], path: Path, title: str, final: tuple[float, float] | None = None) -> None:
    """The run's curves (:mod:`spinwheel.train.curves`, the look of every command): training-episode return per
    update against environment steps, the deterministic evaluation at the end, and the update's figures that move."""
    from spinwheel.train.curves import plot_runs

    records = list(history)
    if final is not None and history and not math.isnan(final[0]):
        records.append({"eval": {"env_steps": history[-1]["env_steps"], "eval_return_mean": final[0]}})
    plot_runs([("", records)], path, title)
