"""The options every training run has (``spinwheel sft | grpo | … | dpo | rm``): what it starts from, where it
writes, how long it runs, the optimizer's schedule, evaluation and checkpoint cadence, resume, placement and
logging; validated once here.

Each command's config extends :class:`RunConfig` with its own options and gives the shared ones its own defaults
with :func:`~spinwheel.config.redefault`. The run harness (:mod:`spinwheel.train.run`) reads these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spinwheel.config import check_ranges, option
from spinwheel.models.hf import resolve_dtype
from spinwheel.models.lora import LoRAConfig
from spinwheel.parallel.config import ParallelConfig
from spinwheel.tasks.arithmetic import ArithmeticConfig


@dataclass
class RunConfig:
    """A training run's shared options."""

    model: str = option(
        "runs/sft/checkpoint",
        help="model to start from: built-in preset (tiny, small, test), HF checkpoint directory, Hugging Face "
        "Hub id (owner/name, through the local HF cache), a GGUF file (or a directory holding one), a named model "
        "(smollm2-135m-instruct), or a PEFT adapter directory: the base it names with the "
        "adapter folded in (with --lora-rank, new adapters train on that merged model, as TRL does from an SFT "
        "adapter)",
        group="model and data",
    )
    data: str | None = option(None, help="JSONL file; default: the built-in arithmetic task", group="model and data")
    eval_fraction: float = option(0.05, help="share of --data lines held out for evaluation", group="model and data")
    out_dir: str = option("runs/run", help="where checkpoint/, metrics.jsonl and curves.png are written", group="run")
    steps: int = option(200, help="optimizer steps", group="run")
    lr: float = option(1e-4, help="peak learning rate (AdamW)", group="optimizer")
    min_lr_ratio: float = option(
        1.0, help="final learning rate as a fraction of --lr (cosine decay; 1: constant)", group="optimizer"
    )
    warmup_steps: int = option(0, help="linear warmup optimizer steps", group="optimizer")
    weight_decay: float = option(0.0, help="AdamW decoupled weight decay on weight matrices", group="optimizer")
    grad_clip: float = option(1.0, help="max global gradient norm (0: no clipping)", group="optimizer")
    eval_every: int = option(50, help="evaluate every N steps (0: only at the start and end)", group="run")
    eval_examples: int = option(500, help="held-out examples per evaluation", group="run")
    save_every: int = option(50, help="write a checkpoint every N steps (0: only at the end)", group="run")
    seed: int = option(0, help="seed of the model init (presets), the data order and the samples", group="run")
    resume: bool = option(
        True,
        help="resume from <out_dir>/checkpoint when it exists (options that would change the run's course, e.g. "
        "--lr or --steps, are refused there unless --force)",
        group="run",
    )
    force: bool = option(
        False, help="resume even with options that change the run's course (the changes are printed)", group="run"
    )
    dtype: str = option("float32", help="parameter dtype: float32, bfloat16 or float16 (GPUs)", group="run")
    device: str = option("cpu", help="torch device, e.g. cpu or cuda", group="run")
    num_threads: int = option(0, help="torch CPU threads (0: PyTorch's default)", group="run")
    stop_after: int | None = option(
        None,
        help="stop (with a checkpoint) after this many steps of this run; resume later with the same command",
        group="run",
    )
    progress: bool = option(True, help="show a progress bar", group="run")
    report_to: Literal["none", "tensorboard", "wandb"] = option(
        "none",
        help="also log every metric to TensorBoard (<out-dir>/tensorboard) or Weights & Biases (offline unless "
        "WANDB_MODE / an API key say otherwise); the main rank only",
        group="run",
    )
    lora_rank: int = option(
        0, help="train LoRA adapters of this rank on a frozen base (0: train every parameter)", group="model and data"
    )
    lora_alpha: float = option(
        16.0, help="LoRA scaling alpha (the update is scaled by alpha / rank)", group="model and data"
    )
    lora_dropout: float = option(0.0, help="dropout on the LoRA adapters' input", group="model and data")
    lora_targets: str = option(
        "q,k,v,o,gate,up,down", help="projections LoRA adapts (comma-separated, or all-linear)", group="model and data"
    )
    task: ArithmeticConfig = field(default_factory=ArithmeticConfig, metadata={"cli": False})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"cli": False})

    def __post_init__(self) -> None:
        check_ranges(
            self,
            at_least_1=("steps", "eval_examples", "stop_after"),
            non_negative=(
                "warmup_steps",
                "eval_every",
                "save_every",
                "num_threads",
                "weight_decay",
                "grad_clip",
                "lora_rank",
            ),
            positive=("lr",),
            unit_interval=("min_lr_ratio",),
            open_unit_interval=("eval_fraction",),
        )
        resolve_dtype(self.dtype)
        self.lora_config()  # a bad --lora-* value fails here, in one line

    def lora_config(self) -> LoRAConfig | None:
        """The adapters ``--lora-rank`` asks for, on the base ``--model`` names; None: train every parameter."""
        if not self.lora_rank:
            return None
        return LoRAConfig(
            rank=self.lora_rank,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            targets=self.lora_targets,
            base_model_name_or_path=self.model,
        )
