"""``ClassicConfig``: every option of a classic-control run, with per-algorithm defaults for the fields left unset.

The config knows the algorithms only by name (``ALGO_DEFAULTS``); the algorithms import it, not the other way
round. Each field's help text becomes the ``spinwheel classic`` option of the same name (:mod:`spinwheel.config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spinwheel.config import check_ranges, option

# Per-algorithm defaults for the fields left at None. VPG and TRPO (the algorithms with a separately fitted value
# baseline, baseline.py) share most: 4 environments, GAE λ 0.97 (Spinning Up's), 10 epochs of the critic's fit per
# rollout, no learning-rate decay, no gradient clipping.
_VALUE_BASELINE = dict(num_envs=4, gae_lambda=0.97, update_epochs=10, anneal_lr=False, max_grad_norm=None)
ALGO_DEFAULTS: dict[str, dict[str, object]] = {
    "ppo": dict(
        num_envs=8,
        num_steps=256,
        lr=3e-4,
        gae_lambda=0.95,
        minibatch_size=64,
        update_epochs=10,
        anneal_lr=True,
        max_grad_norm=0.5,
    ),
    "trpo": dict(_VALUE_BASELINE, num_steps=512, lr=0.0, minibatch_size=128),
    "vpg": dict(_VALUE_BASELINE, num_steps=256, lr=3e-3, minibatch_size=256),
}


@dataclass
class ClassicConfig:
    """Policy-gradient RL (VPG / TRPO / PPO-clip / PPO-penalty) on a gymnasium environment."""

    algo: Literal["vpg", "trpo", "ppo"] = option("ppo", help="algorithm", group="algorithm")
    env: str = option("CartPole-v1", help="gymnasium environment id (flat Box observations)", group="model and data")
    steps: int = option(100_000, help="total environment steps (all environments, all ranks)", group="run")
    seed: int = option(0, help="seed of weights, environments, action sampling and minibatch order", group="run")
    num_envs: int | None = option(
        None, help="environments in total, split over ranks (ppo 8, trpo 4, vpg 4)", group="rollout"
    )
    num_steps: int | None = option(
        None, help="rollout length per environment per update (ppo 256, trpo 512, vpg 256)", group="rollout"
    )
    gamma: float = option(0.99, help="discount factor", group="algorithm")
    gae_lambda: float | None = option(None, help="GAE λ (ppo 0.95, trpo/vpg 0.97)", group="algorithm")
    hidden_sizes: tuple[int, ...] = option(
        (64, 64), help="hidden layer widths of the actor and of the critic", group="model and data"
    )
    activation: Literal["tanh", "relu"] = option("tanh", help="hidden activation", group="model and data")
    lr: float | None = option(
        None,
        help="Adam learning rate: ppo actor+critic (3e-4), vpg actor (3e-3); unused by trpo",
        group="optimizer",
    )
    vf_lr: float = option(1e-3, help="vpg/trpo critic Adam learning rate", group="optimizer")
    anneal_lr: bool | None = option(
        None, help="decay learning rates linearly to 0 (default: on for ppo)", group="optimizer"
    )
    update_epochs: int | None = option(
        None, help="ppo: epochs over each rollout; vpg/trpo: critic epochs (10)", group="optimizer"
    )
    minibatch_size: int | None = option(
        None, help="samples per minibatch (ppo 64, trpo 128, vpg 256)", group="optimizer"
    )
    norm_adv: bool = option(
        True, help="normalise advantages (per minibatch for ppo, per rollout otherwise)", group="algorithm"
    )
    max_grad_norm: float | None = option(
        None, help="clip the global gradient norm (ppo 0.5, else off; 0: off)", group="optimizer"
    )
    ppo_variant: Literal["clip", "penalty"] = option(
        "clip",
        help="ppo: clipped surrogate, or KL penalty with an adaptive β (Schulman et al. 2017, §4)",
        group="algorithm",
    )
    clip_range: float = option(0.2, help="ppo clip: ratio clip ε", group="algorithm")
    clip_range_vf: float | None = option(
        None, help="ppo: clip value predictions to ±this around old values", group="algorithm"
    )
    ent_coef: float = option(0.0, help="ppo: entropy bonus coefficient", group="algorithm")
    vf_coef: float = option(0.5, help="ppo: value loss coefficient", group="algorithm")
    penalty_beta: float = option(1.0, help="ppo penalty: initial KL coefficient β", group="algorithm")
    penalty_kl_target: float = option(
        0.01,
        help="ppo penalty: KL target d_targ; after each update β halves below "
        "d_targ/1.5 and doubles above 1.5·d_targ (0: β fixed)",
        group="algorithm",
    )
    target_kl: float | None = option(
        None, help="ppo: stop the update when approx-KL exceeds 1.5 × this", group="algorithm"
    )
    max_kl: float = option(0.01, help="trpo: KL radius δ", group="algorithm")
    cg_iters: int = option(10, help="trpo: conjugate-gradient iterations", group="algorithm")
    cg_damping: float = option(0.1, help="trpo: damping added to the Fisher matrix", group="algorithm")
    line_search: bool = option(
        True, help="trpo: backtracking line search (off: natural policy gradient)", group="algorithm"
    )
    backtrack_iters: int = option(10, help="trpo: line-search steps", group="algorithm")
    backtrack_coef: float = option(0.8, help="trpo: line-search shrink factor", group="algorithm")
    normalize_obs: bool = option(False, help="normalise observations by running mean/std", group="model and data")
    normalize_reward: bool = option(
        False, help="scale rewards by the running std of the discounted return", group="model and data"
    )
    clip_obs: float = option(10.0, help="clip normalised observations to ±this", group="model and data")
    clip_reward: float = option(
        10.0, help="clip scaled rewards to ±this (with --normalize-reward)", group="model and data"
    )
    eval_episodes: int = option(10, help="deterministic evaluation episodes at the end", group="run")
    out_dir: str = option("runs/classic", help="where metrics.jsonl, learning_curve.png and policy.pt go", group="run")
    progress: bool = option(True, help="show a progress bar", group="run")
    report_to: Literal["none", "tensorboard", "wandb"] = option(
        "none", help="also log every metric to TensorBoard (<out-dir>/tensorboard) or Weights & Biases", group="run"
    )
    num_threads: int = option(1, help="torch CPU threads (1 is fastest for small MLPs)", group="run")
    dist_timeout_s: float = option(300.0, help="timeout of data-parallel collectives, seconds", group="parallel layout")

    def __post_init__(self) -> None:
        if self.algo not in ALGO_DEFAULTS:
            raise ValueError(f"algo must be one of {sorted(ALGO_DEFAULTS)}, got {self.algo!r}")
        for name, value in ALGO_DEFAULTS[self.algo].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            self.max_grad_norm = None
        self.hidden_sizes = tuple(self.hidden_sizes)
        check_ranges(
            self,
            at_least_1=("num_envs", "num_steps", "minibatch_size", "cg_iters", "backtrack_iters", "num_threads"),
            non_negative=("update_epochs", "penalty_kl_target", "cg_damping", "eval_episodes"),
            positive=("vf_lr", "clip_range", "penalty_beta", "clip_range_vf", "target_kl", "max_kl"),
            fraction=("gamma",),
            unit_interval=("gae_lambda",),
            open_unit_interval=("backtrack_coef",),
            name=str,
            ge="≥",
        )
        checks = [
            (
                self.steps >= self.num_envs * self.num_steps,
                f"steps ({self.steps}) is less than one rollout (num_envs × num_steps = "
                f"{self.num_envs * self.num_steps}); raise --steps or lower --num-steps / --num-envs",
            ),
            (
                len(self.hidden_sizes) > 0 and all(h > 0 for h in self.hidden_sizes),
                f"hidden_sizes must be positive widths, got {self.hidden_sizes}",
            ),
            (self.algo != "ppo" or self.update_epochs >= 1, "ppo needs update_epochs ≥ 1"),
            (self.algo == "trpo" or self.lr > 0, f"lr must be > 0 for {self.algo}, got {self.lr}"),
            (
                self.ppo_variant in ("clip", "penalty"),
                f"ppo_variant must be 'clip' or 'penalty', got {self.ppo_variant!r}",
            ),
            (self.algo == "ppo" or self.ppo_variant == "clip", f"ppo_variant applies to --algo ppo, not {self.algo}"),
            (self.clip_obs > 0 and self.clip_reward > 0, "clip_obs and clip_reward must be > 0"),
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
