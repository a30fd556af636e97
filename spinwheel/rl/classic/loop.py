"""The classic-control training loop: rollout → update per iteration, then evaluation and the saved outputs.

One loop serves VPG, TRPO and PPO: collect ``num_steps`` steps from ``num_envs`` environments, compute
GAE-λ advantages and value targets, hand the batch to the algorithm's ``update``. Under ``torchrun`` each rank
steps its block of the environments and the updates sum gradients over ranks (``data_parallel.py``); rank 0
writes the outputs. With a fixed seed a run is reproducible, and a data-parallel run takes the same steps as
a one-process run with the same ``num_envs``.

Outputs in ``out_dir``: ``metrics.jsonl`` (one line per update, then an ``eval`` line), ``learning_curve.png``,
``policy.pt`` (state dict, observation statistics and config; see :func:`~spinwheel.rl.classic.outputs.load_policy`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from spinwheel.rl.classic.buffer import Batch
from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.data_parallel import DataParallel
from spinwheel.rl.classic.envs import VecEnv, evaluate_policy
from spinwheel.rl.classic.outputs import plot_learning_curve, save_policy
from spinwheel.rl.classic.policies import ActorCritic
from spinwheel.rl.classic.ppo import PPO
from spinwheel.rl.classic.rollout import RolloutCollector
from spinwheel.rl.classic.trpo import TRPO
from spinwheel.rl.classic.vpg import VPG
from spinwheel.rl.losses import explained_variance
from spinwheel.train.metrics import MetricsLogger
from spinwheel.train.report import open_reporter
from spinwheel.train.run import NonFiniteError
from spinwheel.train.run_dir import RunDirLock

ALGORITHMS = {"ppo": PPO, "trpo": TRPO, "vpg": VPG}


def train(config: ClassicConfig, stop: threading.Event | None = None) -> dict:
    """Train, evaluate deterministically, save; returns the final figures (``eval_return_mean`` …).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calls this; rank 0 writes the outputs. Setting ``stop``
    (e.g. from a SIGINT handler) ends the run after the current update, at the same update on every rank: the
    policy, metrics and curve are saved, evaluation is skipped and the result has ``interrupted: True``.
    """
    dp = DataParallel.launch(config.dist_timeout_s)
    try:
        return _train(config, dp, stop)
    finally:
        dp.close()


def _open_metrics(config: ClassicConfig, dp: DataParallel) -> tuple[MetricsLogger | None, RunDirLock | None]:
    """Rank 0 takes ``out_dir`` for this run (a lock: a second run on it fails naming this one's pid) and opens
    ``metrics.jsonl`` and the ``--report-to`` reporter (other ranks get ``None``); every rank learns whether that
    worked, so a bad ``--out-dir`` fails all ranks at once (as it fails one process) instead of leaving the peers
    waiting in a collective."""
    metrics_file, lock, error, out_dir = None, None, None, Path(config.out_dir)
    if dp.is_main:
        try:
            lock = RunDirLock(out_dir).acquire()
            name = f"{config.algo} {config.env} {out_dir}"
            reporter = open_reporter(config.report_to, out_dir, dataclasses.asdict(config), name)
            metrics_file = MetricsLogger(out_dir, reporter=reporter)
        except (OSError, ValueError) as e:
            error = e
            if lock is not None:
                lock.release()
    if dp.sum(torch.tensor([float(error is not None)])).item() > 0:
        raise error or OSError(f"rank 0 cannot write to out_dir {str(out_dir)!r}")
    return metrics_file, lock


def _train(config: ClassicConfig, dp: DataParallel, stop: threading.Event | None) -> dict:
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    env_slice = dp.shard(config.num_envs)
    envs = VecEnv(config.env, env_slice.stop - env_slice.start, config.seed, env_offset=env_slice.start)
    lock = None
    try:
        metrics_file, lock = _open_metrics(config, dp)
        try:
            return _run(config, dp, stop, envs, metrics_file)
        finally:
            if metrics_file is not None:
                metrics_file.close()
    finally:
        envs.close()
        if lock is not None:
            lock.release()


def _run(
    config: ClassicConfig,
    dp: DataParallel,
    stop: threading.Event | None,
    envs: VecEnv,
    metrics_file: MetricsLogger | None,
) -> dict:
    policy = ActorCritic(
        envs.single_observation_space, envs.single_action_space, config.hidden_sizes, config.activation
    )
    algorithm = ALGORITHMS[config.algo](policy, config, dp)
    rollout = RolloutCollector(config, dp, envs, policy)
    shuffle_generator = torch.Generator().manual_seed(config.seed + 2)
    history: list[dict] = []
    bar = tqdm(
        total=config.num_updates * config.rollout_size,
        unit="step",
        dynamic_ncols=True,
        disable=not (config.progress and dp.is_main),
        desc=f"{config.algo} {config.env}",
    )
    start, start_cpu = time.perf_counter(), time.process_time()
    interrupted = False
    try:
        for update in range(config.num_updates):
            batch, returns, lengths = rollout.collect()
            lr_scale = 1.0 - update / config.num_updates if config.anneal_lr else 1.0
            stats = algorithm.update(batch, config.num_envs, shuffle_generator, lr_scale)
            # Episode figures, the stop request and a non-finite update travel in one collective: ranks stop at the
            # same update.
            flags = [float(stop is not None and stop.is_set()), float(_nonfinite(stats) is not None)]
            episodes = dp.sum(
                torch.tensor([sum(returns), float(len(returns)), float(sum(lengths)), *flags], dtype=torch.float64)
            )
            if episodes[4] > 0:
                raise NonFiniteError(
                    f"update {update + 1}: {_nonfinite(stats) or 'a figure'} is not finite; the run stopped without "
                    "saving policy.pt"
                )
            record = _record(config, update, time.perf_counter() - start, episodes, batch, dp, lr_scale, stats)
            history.append(record)
            if metrics_file is not None:  # a line per update, readable while the run goes on (tail -f)
                metrics_file.log(record, step=record["env_steps"])
            bar.update(config.rollout_size)
            if record["episode_return_mean"] is not None:
                bar.set_postfix(ret=f"{record['episode_return_mean']:.1f}", refresh=False)
            if episodes[3] > 0:
                interrupted = update + 1 < config.num_updates
                break
        bar.close()
        seconds = (time.perf_counter() - start, time.process_time() - start_cpu)
        return _finish(config, dp, policy, rollout, history, interrupted, seconds, metrics_file)
    finally:
        bar.close()


def _nonfinite(stats: dict) -> str | None:
    """The first figure of an update's ``stats`` that is not finite, as ``name = value``."""
    for key, v in stats.items():
        if isinstance(v, float) and not math.isfinite(v):
            return f"{key} = {v}"
    return None


def _record(
    config: ClassicConfig,
    update: int,
    elapsed: float,
    episodes: torch.Tensor,
    batch: Batch,
    dp: DataParallel,
    lr_scale: float,
    stats: dict,
) -> dict:
    """One update's line of ``metrics.jsonl``; ``episodes`` = (return sum, episodes, length sum, ...) over ranks."""
    env_steps = (update + 1) * config.rollout_size
    return {
        "update": update + 1,
        "env_steps": env_steps,
        "time_s": round(elapsed, 3),
        "env_steps_per_s": env_steps / elapsed,
        "episodes": int(episodes[1].item()),
        "episode_return_mean": (episodes[0] / episodes[1]).item() if episodes[1] > 0 else None,
        "episode_length_mean": (episodes[2] / episodes[1]).item() if episodes[1] > 0 else None,
        "explained_variance": _explained_variance(batch, dp),
        "lr_scale": lr_scale,
        **stats,
    }


def _finish(
    config: ClassicConfig,
    dp: DataParallel,
    policy: ActorCritic,
    rollout: RolloutCollector,
    history: list[dict],
    interrupted: bool,
    seconds: tuple[float, float],
    metrics_file: MetricsLogger | None,
) -> dict:
    """Evaluate (unless interrupted) and, on rank 0, write the last metrics line, ``policy.pt`` and the curve."""
    env_steps = len(history) * config.rollout_size
    result = {
        "algo": config.algo,
        "env": config.env,
        "seed": config.seed,
        "env_steps": env_steps,
        "train_seconds": seconds[0],
        "train_cpu_seconds": seconds[1],
        "env_steps_per_s": env_steps / max(seconds[0], 1e-9),
        "world_size": dp.world_size,
    }
    if interrupted:
        result.update(interrupted=True, updates=len(history), num_updates=config.num_updates)
    else:
        result.update(_evaluate(policy, rollout, config, dp))
    if dp.is_main:
        out_dir = Path(config.out_dir)
        assert metrics_file is not None
        metrics_file.log({"interrupted" if interrupted else "eval": result}, step=env_steps)
        metrics_file.report({k: v for k, v in result.items() if k.startswith("eval_")}, env_steps)
        save_policy(policy, rollout.obs_rms, config, out_dir / "policy.pt")
        final = None if interrupted else (result["eval_return_mean"], result["eval_return_std"])
        title = f"{config.algo} {config.env} seed {config.seed}"
        plot_learning_curve(history, out_dir / "learning_curve.png", title=title, final=final)
        result["out_dir"] = str(out_dir)
    return result


def _evaluate(policy: ActorCritic, rollout: RolloutCollector, config: ClassicConfig, dp: DataParallel) -> dict:
    """Rank 0 runs the deterministic evaluation episodes; every rank gets the mean and std."""
    result: dict = {}
    eval_figures = torch.full((2,), float("nan"), dtype=torch.float64)
    if dp.is_main:
        eval_returns = evaluate_policy(
            policy,
            config.env,
            config.eval_episodes,
            seed=config.seed + 1_000_000,
            obs_rms=rollout.obs_rms,
            clip_obs=config.clip_obs if config.normalize_obs else None,
        )
        if eval_returns:
            eval_figures = torch.tensor([np.mean(eval_returns), np.std(eval_returns)], dtype=torch.float64)
        result["eval_returns"] = eval_returns
    eval_figures = dp.broadcast(eval_figures)
    result["eval_return_mean"], result["eval_return_std"] = eval_figures.tolist()
    return result


def _explained_variance(batch: Batch, dp: DataParallel) -> float:
    """How well the rollout-time values ``(B,)`` predict the value targets, over every rank's samples."""
    values, returns = dp.gather(batch.values).double(), dp.gather(batch.returns).double()
    return explained_variance(values, returns).item()
