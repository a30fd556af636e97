"""The SFT run's options (``spinwheel sft --help``), validated once here."""

from __future__ import annotations

from dataclasses import dataclass, field

from spinwheel.config import option
from spinwheel.models.hf import resolve_dtype
from spinwheel.parallel.config import ParallelConfig
from spinwheel.tasks.arithmetic import ArithmeticConfig


@dataclass
class SFTConfig:
    """Supervised fine-tuning on completion tokens (built-in arithmetic task or your JSONL)."""

    model: str = option(
        "tiny",
        help="built-in preset (tiny, small, test), HF checkpoint directory or Hugging Face "
        "Hub id (owner/name, through the local HF cache)",
    )
    data: str | None = option(
        None, help="SFT JSONL with {prompt, completion} or {messages} lines; default: the built-in arithmetic task"
    )
    eval_fraction: float = option(0.05, help="share of --data lines held out for evaluation")
    out_dir: str = option("runs/sft", help="where checkpoint/, metrics.jsonl and curves.png are written")
    steps: int = option(1500, help="optimizer steps")
    batch_size: int = option(128, help="sequences per step")
    lr: float = option(3e-3, help="peak learning rate (AdamW)")
    min_lr_ratio: float = option(0.1, help="final learning rate as a fraction of --lr (cosine decay)")
    warmup_steps: int = option(100, help="linear warmup steps")
    weight_decay: float = option(0.1, help="AdamW decoupled weight decay on weight matrices")
    grad_clip: float = option(1.0, help="max global gradient norm (0 disables clipping)")
    eval_every: int = option(500, help="evaluate held-out exact match every N steps (0: only at the end)")
    eval_examples: int = option(500, help="held-out examples per evaluation")
    max_new_tokens: int = option(16, help="max tokens generated per held-out prompt at evaluation")
    eval_engine: bool = option(
        True,
        help="evaluate with the paged-attention serving engine (--no-eval-engine: the plain reference generate loop)",
    )
    save_every: int = option(500, help="write a checkpoint every N steps (0: only at the end)")
    max_seq_len: int = option(256, help="longer examples are dropped (their count is reported)")
    seed: int = option(0, help="seed of the model init and the data order")
    resume: bool = option(
        True,
        help="resume from <out_dir>/checkpoint when it exists (options that would change "
        "the run's course, e.g. --lr or --steps, are refused there unless --force)",
    )
    force: bool = option(False, help="resume even with options that change the run's course (the changes are printed)")
    dtype: str = option("float32", help="parameter dtype: float32, bfloat16 or float16 (GPUs)")
    device: str = option("cpu", help="torch device, e.g. cpu or cuda")
    num_threads: int = option(0, help="torch CPU threads (0: PyTorch's default)")
    stop_after: int | None = option(
        None, help="stop (with a checkpoint) after this many steps of this run; resume later with the same command"
    )
    progress: bool = option(True, help="show a progress bar")
    task: ArithmeticConfig = field(default_factory=ArithmeticConfig, metadata={"cli": False})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"cli": False})

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_examples", "max_new_tokens", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "save_every", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"--stop-after must be >= 1, got {self.stop_after}")
        resolve_dtype(self.dtype)
