"""Curves a person reads, drawn from ``metrics.jsonl``: one look for every command (SFT, the RL family, DPO, RM,
classic control) and for ``spinwheel plot``, which overlays runs.

Which panels: :data:`PANELS` lists every figure worth a panel, each with a title saying what it is and on which
data; :func:`choose_panels` keeps those present in this run *that move* — a KL at β = 0 or a clip fraction with
one update per rollout stays at zero and gets no panel — and always the held-out curve. How: noisy per-step
figures are drawn faint with an exponential moving average over them (TensorBoard's smoothing), held-out figures
as points joined by lines, the x axis is the optimizer step (environment steps for classic control).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Panel:
    """One panel: ``key`` of the records, its ``title`` and y label; ``style`` noisy (EMA over the faint raw
    curve), heldout (points and lines) or plain; a series whose span is at most ``floor`` does not move."""

    key: str
    title: str
    ylabel: str
    style: str = "noisy"
    floor: float = 1e-9


PANELS: tuple[Panel, ...] = (
    Panel("reward_mean", "sampled reward (training rollouts)", "mean reward"),
    Panel("eval_exact_match", "held-out exact match (greedy, never trained on)", "exact match", "heldout"),
    Panel("eval_reward", "held-out mean reward (greedy, never trained on)", "mean reward", "heldout"),
    Panel("episode_return_mean", "episode return (training episodes)", "return"),
    Panel("eval_return_mean", "deterministic evaluation return", "return", "heldout"),
    Panel("eval_accuracy", "held-out pair accuracy (random wrong answers)", "accuracy", "heldout"),
    Panel("eval_policy_accuracy", "held-out pair accuracy (the policy's mistakes)", "accuracy", "heldout"),
    Panel("eval_margin", "held-out reward margin (chosen - rejected)", "margin", "heldout"),
    Panel("loss", "training loss (this step's batch)", "loss"),
    Panel("accuracy", "pair accuracy (this step's batch)", "accuracy"),
    Panel("margin", "reward margin (this step's batch)", "margin"),
    Panel("kl_ref", "KL(policy ‖ reference), sampled tokens", "KL", floor=1e-6),
    Panel("approx_kl", "KL(old ‖ new) of the update", "KL", floor=1e-6),
    Panel("clip_frac", "clipped token fraction of the update", "fraction", floor=1e-6),
    Panel("entropy", "policy entropy (sampled tokens)", "nats / token"),
    Panel("response_len", "completion length (training rollouts)", "tokens"),
    Panel("mismatch_max", "engine vs trainer log-prob mismatch (max)", "|Δ log p|", floor=1e-3),
    Panel("explained_variance", "value function explained variance", "explained variance"),
    Panel("grad_norm", "gradient norm (before clipping)", "norm"),
    Panel("lr", "learning rate", "lr", "plain"),
    Panel("time/step", "step time (wall)", "seconds"),
)
MAX_PANELS = 12


def x_key(records: Sequence[dict[str, Any]]) -> str:
    """The x axis of a run's records: ``env_steps`` for classic control, else the optimizer ``step``."""
    return "env_steps" if any("env_steps" in r and "update" in r for r in records) else "step"


def flatten(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Classic control's closing ``{"eval": {...}}`` row as a row of its own figures at the last x, and its
    cumulative ``time_s`` as each update's ``time/step``; other rows as they are."""
    out: list[dict[str, Any]] = []
    last_x, last_t = 0, 0.0
    for r in records:
        if "eval" in r and isinstance(r["eval"], dict):
            out.append({"env_steps": r["eval"].get("env_steps", last_x), **r["eval"]})
            continue
        row = dict(r)
        if "time_s" in r and "time/step" not in r:
            row["time/step"], last_t = r["time_s"] - last_t, r["time_s"]
        last_x = r.get("env_steps", last_x)
        out.append(row)
    return out


def series(records: Sequence[dict[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of the finite values of ``key``."""
    points = [(r[x], r[key]) for r in records if x in r and _number(r.get(key))]
    return [float(p[0]) for p in points], [float(p[1]) for p in points]


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def moves(values: Sequence[float], floor: float) -> bool:
    """Whether a series changes over the run by more than ``floor`` (and float noise)."""
    return len(values) > 1 and max(values) - min(values) > floor + 1e-6 * max(abs(v) for v in values)


def choose_panels(runs: Sequence[Sequence[dict[str, Any]]], extra: Sequence[tuple[str, str]] = ()) -> list[Panel]:
    """The panels for ``runs`` (each a run's flattened records): every held-out figure present, every other figure
    of :data:`PANELS` that moves in one of them, then ``extra`` (``(key, label)`` a command adds) that move."""
    known = {p.key for p in PANELS}
    candidates = [*PANELS, *(Panel(k, label, label) for k, label in extra if k not in known)]
    chosen = []
    for panel in candidates:
        values = [series(r, panel.key, x_key(r))[1] for r in runs]
        present = any(values)
        if present and (panel.style == "heldout" or any(moves(v, panel.floor) for v in values)):
            chosen.append(panel)
    return chosen[:MAX_PANELS]


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average (``weight`` of the past, 0: none)."""
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last, norm = last * weight + (1 - weight) * v, norm * weight + (1 - weight)
        out.append(last / norm)
    return out


def smoothing(n: int) -> float:
    """The EMA weight for ``n`` points: about n/20 points of memory (none under 10 points)."""
    return 0.0 if n < 10 else 1 - 2 / (max(3.0, n / 20) + 1)


def _draw(ax, panel: Panel, xs: list[float], ys: list[float], color: str, label: str | None) -> None:
    if panel.style == "heldout":
        ax.plot(xs, ys, "-o", color=color, markersize=3, label=label)
    elif panel.style == "noisy" and len(ys) >= 10:
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(xs, ema(ys, smoothing(len(ys))), color=color, linewidth=1.6, label=label)
    else:
        ax.plot(xs, ys, color=color, marker="o" if len(ys) < 30 else None, markersize=3, label=label)


def plot_runs(
    runs: Sequence[tuple[str, Sequence[dict[str, Any]]]],
    path: str | os.PathLike,
    title: str = "",
    extra: Sequence[tuple[str, str]] = (),
) -> list[Panel]:
    """The chosen panels of ``runs`` (``(label, records)``; one run: no legend) in a grid, saved as a PNG; returns
    the panels drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    flat = [(label, flatten(records)) for label, records in runs]
    panels = choose_panels([records for _, records in flat], extra) or [Panel("step", "no figures yet", "")]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows))
    FigureCanvasAgg(fig)
    colors = [f"C{i % 10}" for i in range(len(flat))]
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for (label, records), color in zip(flat, colors):
            xs, ys = series(records, panel.key, x_key(records))
            if ys:
                _draw(ax, panel, xs, ys, color, label if len(flat) > 1 else None)
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("environment steps" if any(x_key(r) == "env_steps" for _, r in flat) else "step", fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if i == 0 and len(flat) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return panels
