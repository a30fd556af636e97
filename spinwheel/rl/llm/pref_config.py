"""Options of the preference runs (``spinwheel dpo --help``, ``spinwheel rm --help``), validated once here.

:class:`PreferenceConfig` holds what both share (model, pairs, optimisation, evaluation, logging, sampling from a
policy on the engine); :class:`DPOConfig` and :class:`RMConfig` add their losses' knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spinwheel.config import option
from spinwheel.engine.config import EngineConfig
from spinwheel.models.hf import resolve_dtype
from spinwheel.parallel.config import ParallelConfig
from spinwheel.tasks.arithmetic import ArithmeticConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class PreferenceConfig:
    """Training on preference pairs (built-in arithmetic task or a {prompt, chosen, rejected} JSONL)."""

    model: str = option("runs/sft/checkpoint", help="checkpoint (or preset) to start from")
    data: str | None = option(
        None,
        help="preference JSONL with {prompt, chosen, rejected} lines; default: pairs built from the arithmetic task",
    )
    eval_fraction: float = option(0.05, help="share of the pairs held out for evaluation")
    out_dir: str = option("runs/pref", help="where checkpoint/, metrics.jsonl and curves.png are written")
    steps: int = option(200, help="optimizer steps")
    batch_size: int = option(32, help="preference pairs per step (each pair is two sequences)")
    lr: float = option(1e-4, help="peak learning rate (AdamW)")
    min_lr_ratio: float = option(1.0, help="final learning rate as a fraction of --lr (cosine decay; 1: constant)")
    warmup_steps: int = option(10, help="linear warmup steps")
    weight_decay: float = option(0.0, help="AdamW decoupled weight decay on weight matrices")
    grad_clip: float = option(1.0, help="max global gradient norm (0: no clipping)")
    max_seq_len: int = option(256, help="pairs longer than this many tokens (prompt + completion) are dropped")
    group_size: int = option(8, help="completions sampled per prompt when pairs come from a policy's samples")
    max_new_tokens: int = option(8, help="max tokens per sampled completion")
    temperature: float = option(1.0, help="sampling temperature of a policy's samples")
    top_p: float = option(1.0, help="nucleus sampling of a policy's samples")
    eval_every: int = option(50, help="evaluate every N steps (0: only at the start and end)")
    eval_examples: int = option(500, help="held-out prompts / pairs per evaluation")
    save_every: int = option(100, help="write a checkpoint every N steps (0: only at the end)")
    seed: int = option(0, help="seed of the pairs, their order and the samples")
    resume: bool = option(
        True,
        help="resume from <out_dir>/checkpoint when it exists (options that would change the run's course, e.g. "
        "--lr or --beta, are refused there unless --force)",
    )
    force: bool = option(False, help="resume even with options that change the run's course (the changes are printed)")
    dtype: str = option("float32", help="parameter dtype: float32, bfloat16 or float16 (GPUs)")
    device: str = option("cpu", help="torch device, e.g. cpu or cuda")
    num_threads: int = option(0, help="torch CPU threads (0: PyTorch's default)")
    stop_after: int | None = option(None, help="stop (with a checkpoint) after this many steps of this run")
    progress: bool = option(True, help="show a progress bar")
    task: ArithmeticConfig = field(default_factory=ArithmeticConfig, metadata={"cli": False})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"cli": False})
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"cli": False})

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_seq_len", "group_size", "max_new_tokens", "eval_examples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every", "num_threads", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 (pairs need varied samples), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"--stop-after must be >= 1, got {self.stop_after}")
        resolve_dtype(self.dtype)


@dataclass
class DPOConfig(PreferenceConfig):
    """Direct preference optimisation of a policy against a frozen reference, on JSONL or self-generated pairs."""

    out_dir: str = option("runs/dpo", help="where checkpoint/, metrics.jsonl and curves.png are written")
    ref_model: str | None = option(None, help="frozen reference policy (default: --model, the starting policy)")
    loss_type: Literal["sigmoid", "ipo"] = option(
        "sigmoid",
        help="sigmoid (DPO; with --label-smoothing: conservative DPO) or ipo (on length-averaged log-probs)",
        choices=("sigmoid", "ipo"),
    )
    beta: float = option(0.1, help="β: strength of the KL anchor to the reference (IPO's τ)")
    label_smoothing: float = option(0.0, help="conservative DPO: probability ε in [0, 0.5] that a label is flipped")
    nll_weight: float = option(
        0.0,
        help="RPO: add this times the token-mean NLL of the chosen completions, so "
        "DPO does not lower the likelihood of the preferred answers (0: off)",
    )
    num_prompts: int = option(
        1024,
        help="self-generated pairs: task prompts to sample --group-size completions for "
        "(prompts whose samples are all right or all wrong give no pair)",
    )
    pairs_per_prompt: int = option(1, help="self-generated pairs: most (correct, wrong) pairs kept per prompt")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing <= 0.5:
            raise ValueError(f"--label-smoothing must be in [0, 0.5], got {self.label_smoothing}")
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ValueError("--label-smoothing applies to --loss-type sigmoid only; IPO has none")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"--loss-type must be sigmoid or ipo, got {self.loss_type!r}")
        if self.nll_weight < 0:
            raise ValueError(f"--nll-weight must be >= 0, got {self.nll_weight}")
        for name in ("num_prompts", "pairs_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.data is None and self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 to pair a correct with a wrong sample, got {self.group_size}")


@dataclass
class RMConfig(PreferenceConfig):
    """Reward-model training (Bradley–Terry) of a scalar-head model on preference pairs."""

    model: str = option(
        "runs/sft/checkpoint",
        help="checkpoint (or preset) to start from: an LM gets a fresh "
        "score head on a copy of its body, a reward model trains on",
    )
    out_dir: str = option("runs/rm", help="where checkpoint/, metrics.jsonl and curves.png are written")
    steps: int = option(600, help="optimizer steps")
    lr: float = option(1e-3, help="peak learning rate (AdamW)")
    num_train_pairs: int = option(
        4000,
        help="built-in task: training pairs (one per training problem, the right answer against a random wrong number)",
    )
    policy: str | None = option(
        None,
        help="policy checkpoint whose own wrong answers on held-out prompts form a "
        "second test set (chosen: the right answer; rejected: its mistake)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_train_pairs < 1:
            raise ValueError(f"--num-train-pairs must be >= 1, got {self.num_train_pairs}")
