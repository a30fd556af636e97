"""Resuming a run: what changed between the config a checkpoint was trained with and this run's, and whether the
run can still continue exactly.

A checkpoint stores its run's config (``trainer_state.pt``: ``"config"``, as ``dataclasses.asdict``). Rerunning the
command compares the two option by option. Options that only change what is observed or when (evaluation cadence,
checkpoint cadence, the stopping point, threads, the progress bar) are taken and printed; options that change the
trajectory (learning rate and schedule, batch, data, seed, model, dtype, device, layout) would make the resumed run
a different run than the one the checkpoint continues, so they are refused unless ``force``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Options that only change what is observed or when, or how the same values are computed: changing them on
# resume keeps the run exact (re-materialisation recomputes what it dropped; it changes memory and time only).
OBSERVATION_OPTIONS = frozenset(
    {
        "out_dir",
        "eval_every",
        "eval_examples",
        "save_every",
        "stop_after",
        "resume",
        "force",
        "num_threads",
        "progress",
        "report_to",
        "reward_timeout_s",
        "parallel.timeout_s",
        "parallel.remat",
        "parallel.remat_k",
        "parallel.remat_partition",
        "parallel.remat_contiguous",
    }
)


@dataclass(frozen=True)
class Change:
    """One option whose value differs; ``key`` is the flattened config field (``lr``, ``task.num_train``)."""

    key: str
    old: Any
    new: Any

    @property
    def option(self) -> str:
        """The command-line spelling: ``task.num_train`` -> ``--task-num-train``, ``parallel.dp`` -> ``--dp``."""
        group, _, name = self.key.rpartition(".")
        prefix = "" if group in ("", "parallel") else group + "-"
        return "--" + (prefix + name).replace("_", "-")

    def __str__(self) -> str:
        return f"{self.option} {self.old!r} -> {self.new!r}"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out


def config_changes(stored: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The options set differently in ``new`` than in ``stored`` (fields only one of them has are skipped: a
    checkpoint from an older spinwheel lacks the newer options)."""
    old, cur = _flatten(stored), _flatten(new)
    if isinstance(old.get("parallel.remat"), bool):  # before re-materialisation had modes it was on or off
        old["parallel.remat"] = "block" if old["parallel.remat"] else "none"
    return [Change(k, old[k], cur[k]) for k in cur if k in old and old[k] != cur[k]]


def check_resume(
    stored: dict[str, Any] | None, new: dict[str, Any], harmless: Collection[str], force: bool, where: str
) -> list[Change]:
    """The changes from ``stored`` to ``new``; raises :class:`ValueError` (one line naming them) when one outside
    ``harmless`` breaks exact resume and ``force`` is off. ``where``: the checkpoint, for the message."""
    if stored is None:  # written before checkpoints stored their config
        return []
    changes = config_changes(stored, new)
    breaking = [c for c in changes if c.key not in harmless]
    if breaking and not force:
        raise ValueError(
            f"{where} was trained with other settings ({', '.join(map(str, breaking))}): resuming with "
            "them would not continue the same run. Rerun with the stored values, add --force to "
            "continue with the new ones, or --no-resume to start over"
        )
    return changes


def resume_point(
    config: Any, state: dict[str, Any], ckpt_dir: Path, harmless: Collection[str]
) -> tuple[int, list[Change]]:
    """The checkpoint's step and the options changed since (``config``: a run config with ``steps``,
    ``min_lr_ratio`` and ``force``); refuses what breaks exact resume and a checkpoint already past ``--steps``."""
    start_step = int(state["step"])
    if start_step > config.steps:
        raise ValueError(
            f"{ckpt_dir} is at step {start_step}, past --steps {config.steps}; rerun with --steps "
            f">= {start_step}, or --no-resume to start over"
        )
    # --steps sets the length of the cosine decay, so it changes every later learning rate unless lr is constant.
    harmless = set(harmless) | ({"steps"} if config.min_lr_ratio == 1 else set())
    changes = check_resume(state.get("config"), dataclasses.asdict(config), harmless, config.force, str(ckpt_dir))
    return start_step, changes


def resume_message(start_step: int, steps: int, ckpt_dir: Path, changes: list[Change]) -> str:
    """The line a resumed run prints: where it continues and what changed."""
    shown = [str(c) for c in changes if c.key not in ("resume", "force")]
    return f"resuming from step {start_step} of {steps} ({ckpt_dir})" + (
        f"; changed: {', '.join(shown)}" if shown else ""
    )


def finished_message(start_step: int, steps: int, ckpt_dir: Path) -> str:
    return (
        f"{ckpt_dir} is at step {start_step} of {steps}: the run is finished, nothing to do "
        "(--no-resume or another --out-dir starts a new run)"
    )
