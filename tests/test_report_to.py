"""``--report-to``: TensorBoard's own reader (``EventAccumulator``) reads back every figure of ``metrics.jsonl`` at its
step (train loss, sampled reward, held-out figures under ``eval/``) for sft, grpo and classic; W&B offline writes
its run directory; a backend that is not installed is one line naming the pip command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import run_cli

from spinwheel.train import report
from spinwheel.train.metrics import read_metrics

TINY = ["--model", "test", "--no-progress", "--num-threads", "1", "--task-num-digits", "1", "--task-num-train", "40"]
TINY += ["--task-num-test", "4", "--eval-examples", "4", "--save-every", "0"]
SFT = ["sft", *TINY, "--steps", "4", "--batch-size", "4", "--lr", "3e-3", "--eval-every", "2", "--max-new-tokens", "3"]
GRPO = ["grpo", *TINY, "--steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "3"]
GRPO += ["--eval-every", "2", "--lr", "3e-3"]

needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="no tensorboard")


def tensorboard_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of ``out/tensorboard`` as (step, value) lists, read by TensorBoard's own loader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def jsonl_series(out: Path, key: str, step_key: str = "step") -> list[tuple[int, float]]:
    return [(r[step_key], r[key]) for r in read_metrics(out / "metrics.jsonl") if r.get(key) is not None]


def assert_same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in want] and len(want) > 0
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=1e-7)  # stored as float32


@needs_tensorboard
def test_sft_and_grpo_scalars_read_back(tmp_path, capfd):
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    assert run_cli([*SFT, "--out-dir", str(sft), "--report-to", "tensorboard"], capfd).returncode == 0
    got = tensorboard_scalars(sft)
    assert_same(got["train/loss"], jsonl_series(sft, "loss"))
    assert_same(got["train/lr"], jsonl_series(sft, "lr"))
    assert [s for s, _ in got["eval/exact_match"]] == [0, 2, 4]  # before, every 2 steps, after
    assert_same(got["eval/exact_match"], jsonl_series(sft, "eval_exact_match"))
    assert [s for s, _ in got["time/step"]] == [1, 2, 3, 4]

    assert run_cli([*GRPO, "--out-dir", str(grpo), "--report-to", "tensorboard"], capfd).returncode == 0
    got = tensorboard_scalars(grpo)
    for key in ("reward_mean", "loss", "entropy", "response_len"):
        assert_same(got[f"train/{key}"], jsonl_series(grpo, key))
    assert_same(got["eval/exact_match"], jsonl_series(grpo, "eval_exact_match"))
    assert [s for s, _ in got["eval/exact_match"]] == [0, 2, 4]
    assert_same(got["time/generate"], jsonl_series(grpo, "time/generate"))
    assert "train/algo" not in got  # text is not a scalar


@needs_tensorboard
def test_options_as_hparams(tmp_path, capfd):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert run_cli([*SFT, "--steps", "1", "--out-dir", str(out), "--report-to", "tensorboard"], capfd).returncode == 0
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert "config/text_summary" in acc.Tags()["tensors"]  # the options as text
    assert "_hparams_/session_start_info" in acc.summary_metadata  # the hparams table's start record
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.003' in text and '"task.num_digits": 1' in text


@needs_tensorboard
def test_classic_scalars_at_env_steps(tmp_path, capfd):
    out = tmp_path / "classic"
    argv = ["classic", "--algo", "vpg", "--env", "CartPole-v1", "--steps", "2048", "--num-envs", "2"]
    argv += ["--num-steps", "256", "--eval-episodes", "1", "--no-progress", "--report-to", "tensorboard"]
    assert run_cli([*argv, "--out-dir", str(out)], capfd).returncode == 0
    got = tensorboard_scalars(out)
    assert_same(got["train/episode_return_mean"], jsonl_series(out, "episode_return_mean", "env_steps"))
    assert [s for s, _ in got["eval/return_mean"]] == [2048]


def test_missing_backend_is_one_line(tmp_path, capfd, monkeypatch):
    monkeypatch.setitem(report.PACKAGES, "tensorboard", "no_such_package_for_spinwheel")
    proc = run_cli([*SFT, "--out-dir", str(tmp_path / "run"), "--report-to", "tensorboard"], capfd)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "pip install 'spinwheel[tensorboard]'" in lines[0] and "--report-to tensorboard" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before the run started


def test_tags():
    assert report.tag("eval_exact_match") == "eval/exact_match"
    assert report.tag("time/update") == "time/update" and report.tag("loss") == "train/loss"
    record = {"step": 3, "loss": 0.5, "algo": "grpo", "ok": True, "x": None, "n": 2, "bad": float("nan")}
    assert report.scalars(record) == {"train/loss": 0.5, "train/n": 2.0}


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="the wandb extra is not installed")
def test_wandb_offline_writes_a_run(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert run_cli([*SFT, "--steps", "2", "--out-dir", str(out), "--report-to", "wandb"], capfd).returncode == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((out / "wandb").iterdir())
