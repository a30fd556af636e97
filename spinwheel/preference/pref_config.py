"""Options of the preference runs (``spinwheel dpo --help``, ``spinwheel rm --help``), validated once here.

:class:`PreferenceConfig` holds what both share (model, pairs, optimisation, evaluation, logging, sampling from a
policy on the engine); :class:`DPOConfig` and :class:`RMConfig` add their losses' knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spinwheel.config import check_ranges, option, redefault
from spinwheel.engine.config import EngineConfig
from spinwheel.train.run_config import RunConfig


@dataclass
@redefault(
    data=option(
        None,
        help="preference JSONL with {prompt, chosen, rejected} lines; default: pairs built from the arithmetic task",
    ),
    eval_fraction=option(0.05, help="share of the pairs held out for evaluation"),
    out_dir="runs/pref",
    warmup_steps=10,
    save_every=100,
)
class PreferenceConfig(RunConfig):
    """Training on preference pairs (built-in arithmetic task or a {prompt, chosen, rejected} JSONL)."""

    batch_size: int = option(32, help="preference pairs per step (each pair is two sequences)", group="optimizer")
    max_seq_len: int = option(
        256, help="pairs longer than this many tokens (prompt + completion) are dropped", group="model and data"
    )
    group_size: int = option(
        8, help="completions sampled per prompt when pairs come from a policy's samples", group="rollout"
    )
    max_new_tokens: int = option(8, help="max tokens per sampled completion", group="rollout")
    temperature: float = option(1.0, help="sampling temperature of a policy's samples", group="rollout")
    top_p: float = option(1.0, help="nucleus sampling of a policy's samples", group="rollout")
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"cli": False})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(
            self, at_least_1=("batch_size", "max_seq_len", "group_size", "max_new_tokens"), fraction=("top_p",)
        )
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 (pairs need varied samples), got {self.temperature}")


@dataclass
@redefault(out_dir="runs/dpo")
class DPOConfig(PreferenceConfig):
    """Direct preference optimisation of a policy against a frozen reference, on JSONL or self-generated pairs."""

    ref_model: str | None = option(
        None, help="frozen reference policy (default: --model, the starting policy)", group="algorithm"
    )
    loss_type: Literal["sigmoid", "ipo"] = option(
        "sigmoid",
        help="sigmoid (DPO; with --label-smoothing: conservative DPO) or ipo (on length-averaged log-probs)",
        group="algorithm",
    )
    beta: float = option(0.1, help="β: strength of the KL anchor to the reference (IPO's τ)", group="algorithm")
    label_smoothing: float = option(
        0.0, help="conservative DPO: probability ε in [0, 0.5] that a label is flipped", group="algorithm"
    )
    nll_weight: float = option(
        0.0,
        help="RPO: add this times the token-mean NLL of the chosen completions, so "
        "DPO does not lower the likelihood of the preferred answers (0: off)",
        group="algorithm",
    )
    num_prompts: int = option(
        1024,
        help="self-generated pairs: task prompts to sample --group-size completions for "
        "(prompts whose samples are all right or all wrong give no pair)",
        group="model and data",
    )
    pairs_per_prompt: int = option(
        1, help="self-generated pairs: most (correct, wrong) pairs kept per prompt", group="model and data"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(self, positive=("beta",))
        if not 0 <= self.label_smoothing <= 0.5:
            raise ValueError(f"--label-smoothing must be in [0, 0.5], got {self.label_smoothing}")
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ValueError("--label-smoothing applies to --loss-type sigmoid only; IPO has none")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"--loss-type must be sigmoid or ipo, got {self.loss_type!r}")
        check_ranges(self, at_least_1=("num_prompts", "pairs_per_prompt"), non_negative=("nll_weight",))
        if self.data is None and self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 to pair a correct with a wrong sample, got {self.group_size}")


@dataclass
@redefault(
    model=option(
        "runs/sft/checkpoint",
        help="checkpoint (or preset) to start from: an LM gets a fresh "
        "score head on a copy of its body, a reward model trains on",
    ),
    out_dir="runs/rm",
    steps=600,
    lr=1e-3,
)
class RMConfig(PreferenceConfig):
    """Reward-model training (Bradley–Terry) of a scalar-head model on preference pairs."""

    num_train_pairs: int = option(
        4000,
        help="built-in task: training pairs (one per training problem, the right answer against a random wrong number)",
        group="model and data",
    )
    policy: str | None = option(
        None,
        help="policy checkpoint whose own wrong answers on held-out prompts form a "
        "second test set (chosen: the right answer; rejected: its mistake)",
        group="model and data",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ranges(self, at_least_1=("num_train_pairs",))
