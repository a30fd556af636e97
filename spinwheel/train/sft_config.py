"""The SFT run's options (``spinwheel sft --help``), validated once here."""

from __future__ import annotations

from dataclasses import dataclass

from spinwheel.config import check_ranges, option, redefault
from spinwheel.models.lora import LoRAConfig
from spinwheel.train.run_config import RunConfig


@dataclass
@redefault(
    model="tiny",
    data=option(
        None, help="SFT JSONL with {prompt, completion} or {messages} lines; default: the built-in arithmetic task"
    ),
    out_dir="runs/sft",
    steps=1500,
    lr=3e-3,
    min_lr_ratio=0.1,
    warmup_steps=100,
    weight_decay=0.1,
    eval_every=500,
    save_every=500,
)
class SFTConfig(RunConfig):
    """Supervised fine-tuning on completion tokens (built-in arithmetic task or your JSONL)."""

    batch_size: int = option(128, help="sequences per step", group="optimizer")
    max_seq_len: int = option(256, help="longer examples are dropped (their count is reported)", group="model and data")
    max_new_tokens: int = option(16, help="max tokens generated per held-out prompt at evaluation", group="run")
    eval_engine: bool = option(
        True,
        help="evaluate with the paged-attention serving engine (--no-eval-engine: the plain reference generate loop)",
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

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(self, at_least_1=("batch_size", "max_new_tokens", "max_seq_len"), non_negative=("lora_rank",))
        self.lora_config()  # a bad --lora-* value fails here, in one line

    def lora_config(self) -> LoRAConfig | None:
        """The adapters ``--lora-rank`` asks for, on the base ``--model`` names; None: full fine-tuning."""
        if not self.lora_rank:
            return None
        return LoRAConfig(
            rank=self.lora_rank,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            targets=self.lora_targets,
            base_model_name_or_path=self.model,
        )
