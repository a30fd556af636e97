"""Policy-gradient RL on gymnasium environments: VPG, TRPO (and natural policy gradient) and PPO-clip.

``train(ClassicConfig(algo="ppo", env="CartPole-v1", steps=100_000))`` trains, evaluates deterministically
and writes ``metrics.jsonl``, ``learning_curve.png`` and ``policy.pt`` to ``out_dir``.
"""

from spinwheel.rl.classic.train import ClassicConfig, load_policy, train

__all__ = ["ClassicConfig", "load_policy", "train"]
