"""Options of the LLM policy-gradient runs (``spinwheel grpo | rloo | reinforce-pp --help``), validated once here.

One dataclass for the shared loop (model, prompts, rollouts, optimisation, logging) and the GRPO-family knobs;
the algorithm is the command's choice (``algo``). Defaults follow the measured recipe for the demo's tiny model
(shared/MEASURED.md): small constant learning rate, G = 8, temperature 1, β = 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spinwheel.config import option
from spinwheel.engine.config import EngineConfig
from spinwheel.models.hf import resolve_dtype
from spinwheel.parallel.config import ParallelConfig
from spinwheel.tasks.arithmetic import ArithmeticConfig

RL_ENGINE_DEFAULTS = {"cpu_packed_weights": False}  # where the RL loop's engine differs from EngineConfig's defaults


@dataclass
class RLConfig:
    """Policy-gradient post-training on rollouts from spinwheel's own engine (built-in task or your JSONL)."""

    algo: str = option("grpo", help="the algorithm: the command's name (spinwheel.rl.llm.algorithms.ALGORITHMS)")
    model: str = option("runs/sft/checkpoint", help="policy to start from: HF checkpoint directory or preset")
    data: str | None = option(None, help="RL JSONL with {prompt, answer} lines; default: the built-in task")
    eval_fraction: float = option(0.05, help="share of --data lines held out for evaluation")
    reward: str = option(
        "task",
        help="'task' (exact match of the answer) or a Python function 'module:function' "
        "taking (completions, answers) and returning one float per completion",
    )
    reward_model: str | None = option(
        None, help="reward-model checkpoint (spinwheel rm) scoring prompt+completion (instead of --reward)"
    )
    reward_timeout_s: float | None = option(
        300.0,
        help="seconds one step's reward call (function or reward model) may take; past it the run stops with an "
        "error (Ctrl-C also stops the wait)",
    )
    out_dir: str = option("runs/grpo", help="where checkpoint/, metrics.jsonl and curves.png are written")
    steps: int = option(200, help="rollout steps (each: generate, score, update)")
    prompts_per_step: int = option(8, help="prompts per rollout step")
    group_size: int = option(8, help="completions sampled per prompt (G)")
    max_new_tokens: int = option(8, help="max tokens per completion")
    temperature: float = option(1.0, help="sampling temperature of the rollouts (the loss uses the untempered policy)")
    top_p: float = option(1.0, help="nucleus sampling of the rollouts")
    epochs: int = option(1, help="optimisation passes over each rollout batch (μ)")
    minibatches: int = option(1, help="optimizer steps per pass: the rollout batch is cut into this many minibatches")
    lr: float = option(5e-5, help="learning rate (AdamW; constant after warmup unless --min-lr-ratio < 1)")
    min_lr_ratio: float = option(1.0, help="final learning rate as a fraction of --lr (cosine decay)")
    warmup_steps: int = option(0, help="linear warmup optimizer steps")
    weight_decay: float = option(0.0, help="AdamW decoupled weight decay on weight matrices")
    grad_clip: float = option(1.0, help="max global gradient norm (0: no clipping)")
    beta: float = option(0.0, help="KL coefficient to the frozen reference policy (0: no reference model)")
    kl_estimator: Literal["k1", "k2", "k3"] = option("k3", help="per-token KL estimator", choices=("k1", "k2", "k3"))
    eps_low: float = option(0.2, help="lower clip range of the ratio (1 - eps_low)")
    eps_high: float = option(0.2, help="upper clip range (1 + eps_high); above eps_low: clip-higher (DAPO)")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = option(
        "token-mean",
        help="loss aggregation over tokens and sequences",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    )
    scale_rewards: bool = option(
        True,
        help="GRPO: divide group advantages by the group std (--no-scale-rewards "
        "with --loss-agg seq-mean-token-sum-norm is Dr. GRPO)",
    )
    dynamic_sampling: bool = option(False, help="drop groups whose rewards are all equal from the loss (DAPO)")
    gamma: float = option(1.0, help="ppo: discount of the per-token rewards")
    lam: float = option(1.0, help="ppo: GAE λ (1: Monte-Carlo advantages, as verl; measured better here than 0.95)")
    critic_lr: float = option(1e-4, help="ppo: learning rate of the critic (a scalar-head copy of the policy)")
    value_clip: float | None = option(0.2, help="ppo: clip range of the value loss around the rollout values")
    whiten_advantages: bool = option(True, help="ppo: whiten the GAE advantages over the batch's tokens")
    kl_target: float | None = option(
        None, help="ppo: target KL per sequence for the adaptive β controller (Ziegler et al.); default: a fixed --beta"
    )
    kl_horizon: float = option(10000.0, help="ppo: horizon (samples) of the adaptive β controller")
    max_kl: float = option(2e-3, help="trpo: trust-region radius δ on the mean per-token KL(π_old ‖ π_new)")
    cg_iters: int = option(5, help="trpo: conjugate-gradient iterations")
    cg_damping: float = option(
        1.0,
        help="trpo: damping added to the Fisher-vector products (large for LLMs: a batch's Fisher is nearly singular)",
    )
    fisher_fraction: float = option(
        1.0,
        help="trpo: fraction of the rollout rows (every k-th) the conjugate gradient's Fisher-vector products use; "
        "the gradient and the KL check use all (baselines' TRPO: 0.2)",
    )
    tis_cap: float | None = option(
        None,
        help="truncated importance sampling: weight tokens by min(π_trainer / "
        "π_engine, C) to correct sampler/trainer mismatch (e.g. 2.0)",
    )
    eval_every: int = option(50, help="held-out greedy exact match every N steps (0: only at the start and end)")
    eval_examples: int = option(500, help="held-out prompts per evaluation")
    save_every: int = option(50, help="write a checkpoint every N steps (0: only at the end)")
    seed: int = option(
        0,
        help="seed of the prompt order and of every sample (a function of seed, step, prompt, "
        "sample: the same completions in one process and under any torchrun layout)",
    )
    resume: bool = option(
        True,
        help="resume from <out_dir>/checkpoint when it exists (options that would change the run's course, e.g. "
        "--lr or --group-size, are refused there unless --force)",
    )
    force: bool = option(False, help="resume even with options that change the run's course (the changes are printed)")
    dtype: str = option("float32", help="parameter dtype: float32, bfloat16 or float16 (GPUs)")
    device: str = option("cpu", help="torch device, e.g. cpu or cuda")
    num_threads: int = option(0, help="torch CPU threads (0: PyTorch's default)")
    stop_after: int | None = option(None, help="stop (with a checkpoint) after this many steps of this run")
    progress: bool = option(True, help="show a progress bar")
    task: ArithmeticConfig = field(default_factory=ArithmeticConfig, metadata={"cli": False})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"cli": False})
    # The loop's engine samples from plain weights: oneDNN-packed copies would be repacked after every update, and
    # at RL rollout sizes packing does not speed sampling up (BENCHMARKS.md, GRPO vs TRL).
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(**RL_ENGINE_DEFAULTS), metadata={"cli": False})

    def __post_init__(self) -> None:
        from spinwheel.rl.llm.algorithms import ALGORITHM_OPTIONS, ALGORITHMS  # the registry imports this module

        if self.algo not in ALGORITHMS:
            raise ValueError(f"--algo must be one of {', '.join(ALGORITHMS)}, got {self.algo!r}")
        ALGORITHMS[self.algo].check(self, ALGORITHM_OPTIONS)
        for name in ("steps", "prompts_per_step", "max_new_tokens", "epochs", "minibatches", "eval_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (group baselines need two samples), got {self.group_size}")
        for name in (
            "warmup_steps",
            "eval_every",
            "save_every",
            "num_threads",
            "beta",
            "weight_decay",
            "grad_clip",
            "eps_low",
            "eps_high",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.reward_timeout_s is not None and not 0 < self.reward_timeout_s < float("inf"):
            raise ValueError(f"--reward-timeout-s must be a number of seconds > 0, got {self.reward_timeout_s}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 for sampled rollouts, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("critic_lr", "max_kl", "cg_iters", "kl_horizon"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not 0 < self.fisher_fraction <= 1:
            raise ValueError(f"--fisher-fraction must be in (0, 1], got {self.fisher_fraction}")
        if self.kl_target is not None and self.kl_target <= 0:
            raise ValueError(f"--kl-target must be > 0, got {self.kl_target}")
        if self.kl_target is not None and self.beta == 0:
            raise ValueError("--kl-target adapts --beta: give a starting --beta > 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"--tis-cap must be > 0, got {self.tis_cap}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"--stop-after must be >= 1, got {self.stop_after}")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ValueError(
                f"--minibatches {self.minibatches} must divide the rollout batch of "
                f"{self.prompts_per_step} × {self.group_size} completions"
            )
        resolve_dtype(self.dtype)

    @property
    def rollout_batch(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def updates_per_step(self) -> int:
        return self.epochs * self.minibatches
