"""Policy-gradient RL on gymnasium environments: VPG, TRPO (and natural policy gradient) and PPO-clip.

``train(ClassicConfig(algo="ppo", env="CartPole-v1", steps=100_000))`` trains, evaluates deterministically
and writes ``metrics.jsonl``, ``learning_curve.png`` and ``policy.pt`` to ``out_dir``.

Layout: ``config`` (options and per-algorithm defaults) → ``envs``, ``buffer``, ``policies``, ``optim`` →
``baseline`` (critic fit, advantage normalisation), ``vpg`` / ``trpo`` / ``ppo`` → ``rollout`` → ``loop``
(:func:`train`); ``data_parallel`` (on :mod:`spinwheel.parallel`) and ``outputs`` (``policy.pt``, the curve).
"""

from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.loop import train
from spinwheel.rl.classic.outputs import load_policy

__all__ = ["ClassicConfig", "load_policy", "train"]
