"""The SFT run's options (``spinwheel sft --help``), validated once here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spinwheel.config import check_ranges, option, redefault
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
    chat: Literal["auto", "on", "off"] = option(
        "auto",
        help="render plain prompts (the built-in task's, {prompt, completion} lines) as the user's turn with the "
        "model's chat template and its generation prompt, the completion as the reply (auto: when the tokenizer "
        "has a template of its own; off: raw text)",
        group="model and data",
    )
    system_prompt: str | None = option(
        None,
        help="system message opening every conversation without one of its own (needs the chat template)",
        group="model and data",
    )
    eval_engine: bool = option(
        True,
        help="evaluate with the paged-attention serving engine (--no-eval-engine: the plain reference generate loop)",
        group="run",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(self, at_least_1=("batch_size", "max_new_tokens", "max_seq_len"))
        if self.system_prompt is not None and self.chat == "off":
            raise ValueError("--system-prompt needs chat rendering: drop --chat off, or drop --system-prompt")
