"""Policy-gradient RL on gymnasium environments: VPG, TRPO (and natural policy gradient), PPO-clip and PPO-penalty.

``train(ClassicConfig(algo="ppo", env="CartPole-v1", steps=100_000))`` trains, evaluates deterministically
and writes ``metrics.jsonl``, ``learning_curve.png`` and ``policy.pt`` to ``out_dir``.

Layout: ``config`` (options, per-algorithm defaults) → ``envs``, ``buffer``, ``policies``, ``optim`` →
``baseline`` (critic fit, advantage normalisation) → ``vpg`` / ``trpo`` / ``ppo`` (+ ``kl_penalty``) →
``rollout`` → ``loop`` (:func:`train`) → ``command`` (``spinwheel classic``); beside them ``data_parallel``
(on :mod:`spinwheel.parallel`) and ``outputs`` (``policy.pt``, the learning curve, :func:`evaluate_saved`).
"""

from spinwheel.rl.classic.config import ClassicConfig
from spinwheel.rl.classic.loop import train
from spinwheel.rl.classic.outputs import evaluate_saved, load_policy

__all__ = ["ClassicConfig", "evaluate_saved", "load_policy", "train"]
