"""``spinwheel plot RUN_DIR [RUN_DIR ...]``: the curves of one run, or of several overlaid (seeds, algorithms,
recipes), drawn from their ``metrics.jsonl`` with the look every command's ``curves.png`` has
(:mod:`spinwheel.train.curves`): the panels that move in any of the runs, each run in its own colour."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spinwheel.config import option
from spinwheel.train.curves import plot_runs
from spinwheel.train.metrics import read_metrics


@dataclass
class PlotConfig:
    """Draw the curves of one or more runs (their metrics.jsonl) into one PNG, runs overlaid."""

    run_dirs: list[str] = option(
        None,
        help="run directories holding metrics.jsonl (a training command's --out-dir, or a demo's sft/ or grpo/)",
        default_factory=list,
        positional=True,
    )
    out: str = option("curves.png", help="the PNG written")
    title: str = option("", help="the figure's title (default: the runs' directories)")

    def __post_init__(self) -> None:
        if not self.run_dirs:
            raise ValueError("give at least one run directory: spinwheel plot RUN_DIR [RUN_DIR ...] [--out FILE]")
        for run in self.run_dirs:
            if not (Path(run) / "metrics.jsonl").is_file():
                raise ValueError(f"{run}: no metrics.jsonl there; give a run's --out-dir (e.g. runs/demo/grpo)")


def labels(run_dirs: list[str]) -> list[str]:
    """Short names for the legend: each directory's path without the part all of them share."""
    parts = [Path(r).resolve().parts for r in run_dirs]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    return ["/".join(p[common:]) for p in parts]


def run_plot(config: PlotConfig) -> int:
    runs = [
        (label, read_metrics(Path(d) / "metrics.jsonl")) for label, d in zip(labels(config.run_dirs), config.run_dirs)
    ]
    panels = plot_runs(runs, config.out, config.title or ", ".join(config.run_dirs))
    print(f"wrote {config.out}: {len(runs)} run(s), panels: {', '.join(p.title for p in panels)}")
    return 0
