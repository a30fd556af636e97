"""``--report-to tensorboard | wandb``: every figure of ``metrics.jsonl`` also goes to TensorBoard or Weights & Biases.

The metrics file stays the record; a reporter mirrors each row as it is written (the main rank only, under
torchrun: only the main rank writes the file). Tags follow the TRL / SB3 habit of a prefix per kind of figure:
held-out figures (``eval_*`` keys) under ``eval/``, the phase times already named ``time/...`` as they are, every
other number under ``train/``. Text values (``"algo": "grpo"``) and ``None`` are skipped. The run's options go in
once at the start: TensorBoard's hparams table (and a ``config`` text), W&B's run config.

Both backends are optional extras (``pip install 'spinwheel[tensorboard]'`` / ``'spinwheel[wandb]'``); a missing
one is one line naming the pip command, before the run starts. W&B runs offline unless ``WANDB_MODE`` says
otherwise and an API key is set (``wandb sync`` uploads an offline run later); its files go under
``<out_dir>/wandb/``, TensorBoard's under ``<out_dir>/tensorboard/``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

REPORT_TO = ("none", "tensorboard", "wandb")
# The package that provides each backend, and the extra that installs it.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Reporter(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def check_backend(report_to: str) -> None:
    """One line (ValueError) when ``report_to`` is unknown or its package is not installed."""
    if report_to not in REPORT_TO:
        raise ValueError(f"--report-to {report_to!r}: choose one of {', '.join(REPORT_TO)}")
    package = PACKAGES.get(report_to)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(
            f"--report-to {report_to} needs the {package} package, which is not installed: "
            f"pip install 'spinwheel[{report_to}]' (or pip install {package}), or drop --report-to"
        )


def tag(key: str) -> str:
    """The tag of a ``metrics.jsonl`` key: ``eval_exact_match`` -> ``eval/exact_match``, ``time/update`` as it is,
    ``loss`` -> ``train/loss``."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_") :]
    return key if "/" in key else "train/" + key


def scalars(record: dict[str, Any], skip: tuple[str, ...] = ("step",)) -> dict[str, float]:
    """The finite numbers of a record under their tags (booleans, text, lists and ``None`` are not scalars)."""
    out = {}
    for key, value in record.items():
        if key in skip or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[tag(key)] = float(value)
    return out


def flat_options(options: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested options (``task``, ``parallel``, ``engine``) as ``task.num_digits`` keys; values a table can show."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, dict):
            out.update(flat_options(value, f"{prefix}{key}."))
        elif isinstance(value, bool | int | float | str):
            out[prefix + key] = value
        else:  # None, tuples, lists: as text
            out[prefix + key] = str(value)
    return out


class TensorBoardReporter:
    """Scalars at their steps in ``<out_dir>/tensorboard/`` (a resumed run adds an event file beside the first)."""

    def __init__(self, out_dir: Path, options: dict[str, Any], name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        flat = flat_options(options)
        self.writer.add_text("config", "```\n" + json.dumps(flat, indent=1, sort_keys=True) + "\n```", 0)
        # The hparams table in the same event file (SummaryWriter.add_hparams would start a run of its own).
        for summary in hparams(flat, {}, hparam_domain_discrete=None):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("run", name, 0)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """One W&B run (offline unless ``WANDB_MODE`` and an API key say otherwise), its files in ``<out_dir>/wandb``."""

    def __init__(self, out_dir: Path, options: dict[str, Any], name: str) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "spinwheel"),
            name=name,
            dir=str(out_dir),
            config=flat_options(options),
            mode=mode,
            reinit="create_new",
        )
        self.last_step = -1

    def log(self, record: dict[str, Any], step: int) -> None:
        figures = scalars(record)
        if figures:  # W&B's steps only go forward: a row of an earlier step (a resumed run's) goes in at the last
            self.last_step = max(self.last_step, step)
            self.run.log(figures, step=self.last_step)

    def close(self) -> None:
        self.run.finish()


def open_reporter(report_to: str, out_dir: str | os.PathLike, options: dict[str, Any], name: str) -> Reporter | None:
    """The reporter ``--report-to`` names (None for ``none``); ``options``: the run's config as a dict."""
    check_backend(report_to)
    if report_to == "tensorboard":
        return TensorBoardReporter(Path(out_dir), options, name)
    if report_to == "wandb":
        return WandbReporter(Path(out_dir), options, name)
    return None
