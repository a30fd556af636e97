"""Training metrics: one JSON object per line in ``metrics.jsonl`` (mirrored to ``--report-to``), and the PNG curves
drawn from that file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spinwheel.train.curves import plot_runs
from spinwheel.train.report import Reporter


class MetricsLogger:
    """Appends records to ``<out_dir>/metrics.jsonl``. On resume, records after the resumed step are dropped so the
    file reads as one uninterrupted run. ``reporter`` (``--report-to``) gets every record too, at its step."""

    def __init__(
        self, out_dir: str | os.PathLike, resume_step: int | None = None, reporter: Reporter | None = None
    ) -> None:
        self.reporter = reporter
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        """Append ``record``; the reporter gets it at ``step`` (default: the record's ``"step"``)."""
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.report(record, int(record.get("step", 0)) if step is None else step)

    def report(self, figures: dict[str, Any], step: int) -> None:
        """``figures`` to the reporter only (a row the file holds in another shape)."""
        if self.reporter is not None:
            self.reporter.log(figures, step)

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()
            self.reporter = None

    def read(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(
    records: list[dict[str, Any]], path: str | os.PathLike, panels: list[tuple[str, str]], title: str = ""
) -> None:
    """The run's curves as a PNG (:mod:`spinwheel.train.curves`: the panels that move in this run); ``panels``:
    ``(key, label)`` figures of the command beyond the common ones."""
    plot_runs([("", records)], path, title, extra=panels)
