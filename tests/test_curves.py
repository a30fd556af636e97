"""The curves every command draws (``spinwheel.train.curves``) and ``spinwheel plot``: panels only for figures that
move in the run (no KL panel at β = 0, no clip panel with one update per rollout), the held-out curve always, the
learning rate when scheduled and the step time; TensorBoard's debiased EMA; classic control's rows on its own axis;
the command overlays runs into one PNG and refuses a directory without metrics.jsonl in one line."""

from __future__ import annotations

import json
import math

import pytest
from helpers import run_cli

from spinwheel.train.curves import choose_panels, ema, flatten, moves, x_key


def grpo_records(beta: float, updates: int, steps: int = 40, lr_decay: bool = True) -> list[dict]:
    """A GRPO run's rows as the loop writes them: β = 0 leaves no kl_ref, one update per rollout leaves the clip
    fraction at 0 and approx_kl at float noise."""
    rows: list[dict] = [{"step": 0, "algo": "grpo", "num_train": 100}, {"step": 0, "eval_exact_match": 0.3}]
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "reward_mean": 0.3 + 0.01 * s + 0.05 * math.sin(s),
            "entropy": 0.6 - 0.002 * s,
            "response_len": 3.5,
            "clip_frac": 0.0 if updates == 1 else 0.02 + 0.001 * (s % 3),
            "approx_kl": 1e-9 * (s % 2) if updates == 1 else 1e-3 * (1 + s % 4),
            "mismatch_max": 1e-6 * (s % 3),
            "lr": 1e-4 * (1 - s / (2 * steps)) if lr_decay else 1e-4,
            "time/step": 0.3 + 0.01 * (s % 5),
        }
        if beta:
            row["kl_ref"] = 0.001 * s
        rows.append(row)
        if s % 4 == 0:
            rows.append({"step": s, "eval_exact_match": 0.3 + 0.01 * s})
    return rows


def keys(records, extra=()):
    return [p.key for p in choose_panels([records], extra)]


def test_flat_figures_get_no_panel():
    shown = keys(grpo_records(beta=0.0, updates=1))
    assert shown == ["reward_mean", "eval_exact_match", "entropy", "lr", "time/step"]
    assert "response_len" not in shown  # constant in this run


def test_moving_kl_and_clip_get_panels():
    shown = keys(grpo_records(beta=0.04, updates=4, lr_decay=False))
    assert {"kl_ref", "approx_kl", "clip_frac"} <= set(shown) and "lr" not in shown  # constant lr: no panel


def test_heldout_is_shown_even_when_flat_and_extra_keys_only_when_moving():
    rows = [{"step": 0, "eval_accuracy": 0.5}, {"step": 1, "eval_accuracy": 0.5, "my_fig": 1.0}]
    rows += [{"step": 2, "my_fig": 1.0}, {"step": 3, "other": 2.0}, {"step": 4, "other": 3.0}]
    assert keys(rows, [("my_fig", "mine"), ("other", "other figure")]) == ["eval_accuracy", "other"]


def test_moves_ignores_float_noise():
    assert not moves([0.5, 0.5 + 1e-9], 1e-9) and moves([0.5, 0.51], 1e-9) and not moves([3.0], 0.0)


def test_ema_is_tensorboards_debiased_average():
    assert ema([1.0, 0.0], 0.5) == pytest.approx([1.0, 1 / 3])
    assert ema([2.0, 4.0, 6.0], 0.0) == [2.0, 4.0, 6.0]


def test_classic_rows_on_environment_steps():
    rows = [{"update": u, "env_steps": 512 * u, "time_s": 1.5 * u, "episode_return_mean": 10.0 * u} for u in (1, 2, 3)]
    rows.append({"eval": {"env_steps": 1536, "eval_return_mean": 40.0, "eval_returns": [40.0]}})
    flat = flatten(rows)
    assert x_key(flat) == "env_steps" and flat[-1] == {
        "env_steps": 1536,
        "eval_return_mean": 40.0,
        "eval_returns": [40.0],
    }
    assert [r["time/step"] for r in flat[:3]] == pytest.approx([1.5, 1.5, 1.5])
    assert keys(flat) == ["episode_return_mean", "eval_return_mean"]


def write_run(path, records) -> None:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_command_overlays_runs(tmp_path, capfd):
    write_run(tmp_path / "seed0", grpo_records(0.0, 1))
    write_run(tmp_path / "seed1", grpo_records(0.04, 1))
    out = tmp_path / "both.png"
    proc = run_cli(["plot", str(tmp_path / "seed0"), str(tmp_path / "seed1"), "--out", str(out)], capfd)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "2 run(s)" in proc.stdout and "KL(policy" in proc.stdout  # seed1's KL moves: the overlay has its panel


def test_plot_command_refuses_a_directory_without_metrics(tmp_path, capfd):
    proc = run_cli(["plot", str(tmp_path)], capfd)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "no metrics.jsonl" in lines[0], proc.stderr
    proc = run_cli(["plot"], capfd)
    assert proc.returncode == 2 and "at least one run directory" in proc.stderr
