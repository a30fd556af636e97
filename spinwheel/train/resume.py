"""Resuming a run: what changed between the config a checkpoint was trained with and this run's, and whether the
run can still continue exactly.

A checkpoint stores its run's config (``trainer_state.pt``: ``"config"``, as ``dataclasses.asdict``). Rerunning the
command compares the two option by option. Options that only change what is observed or when (evaluation cadence,
checkpoint cadence, the stopping point, threads, the progress bar) are taken and printed; options that change the
trajectory (learning rate and schedule, batch, data, seed, model, dtype, device, layout) would make the resumed run
a different run than the one the checkpoint continues, so they are refused unless ``force``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any


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
