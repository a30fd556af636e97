"""``spinwheel sft`` under ``torchrun``: the real command on 2 gloo ranks trains like one process — the per-step
losses in ``metrics.jsonl`` equal a single-process run of the same config (relative 1e-5, with warmup + cosine
learning rate, weight decay and gradient clipping active), so do the gradient norms, and the consolidated HF
checkpoint loads with ``spinwheel.load_model`` and holds the single-process weights. ZeRO-3 is run in two halves
(``--stop-after`` then resume from the sharded state), which must give the same losses as one uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import spinwheel
from spinwheel.cli import main
from spinwheel.train.metrics import read_metrics

RTOL = 1e-5
ARGS = [
    "--model",
    "test",
    "--steps",
    "6",
    "--batch-size",
    "8",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
    "--grad-clip",
    "0.5",
    "--eval-every",
    "3",
    "--eval-examples",
    "4",
    "--max-new-tokens",
    "3",
    "--save-every",
    "2",
    "--task-num-digits",
    "1",
    "--task-num-train",
    "40",
    "--task-num-test",
    "6",
    "--no-progress",
    "--num-threads",
    "1",
]


def torchrun(out_dir, *options: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "spinwheel.cli",
        "sft",
        *ARGS,
        "--out-dir",
        str(out_dir),
        *options,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def records(out_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r}


def evals(out_dir) -> list[int]:
    return [r["step"] for r in read_metrics(out_dir / "metrics.jsonl") if "eval_exact_match" in r]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    assert main(["sft", *ARGS, "--out-dir", str(out)]) == 0
    return out


def assert_same_run(out, single) -> None:
    ours, ref = records(out), records(single)
    assert sorted(ours) == list(range(1, 7))
    assert all(ref[s]["grad_norm"] > 0.5 for s in ref)  # clipping is active on every step
    for s in ref:
        assert ours[s]["loss"] == pytest.approx(ref[s]["loss"], rel=RTOL), s
        assert ours[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=RTOL), s
        assert ours[s]["lr"] == ref[s]["lr"]
    assert evals(out) == evals(single) == [0, 3, 6]
    got = spinwheel.load_model(out / "checkpoint").state_dict()
    want = spinwheel.load_model(single / "checkpoint").state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert ((got[k] - v).norm() / v.norm().clamp(min=1e-12)).item() <= RTOL, k


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("options", [["--dp", "2"], ["--tp", "2"]], ids=["dp2", "tp2"])
def test_torchrun_sft_equals_single_process(tmp_path, single, options):
    torchrun(tmp_path, *options)
    assert_same_run(tmp_path, single)
    assert (tmp_path / "checkpoint" / "sharded" / "layout.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary dirs left


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_sft_resumes_exactly(tmp_path, single, capsys):
    torchrun(tmp_path, "--zero", "3", "--stop-after", "3")
    assert max(records(tmp_path)) == 3
    torchrun(tmp_path, "--zero", "3")
    assert_same_run(tmp_path, single)
    # The sharded state belongs to this layout: one process refuses it with a one-line error.
    assert main(["sft", *ARGS, "--out-dir", str(tmp_path), "--steps", "8", "--force"]) == 2
    assert "written by a parallel run" in capsys.readouterr().err
    # And a layout that does not fit the world is a readable error, not a hang.
    assert main(["sft", *ARGS, "--out-dir", str(tmp_path / "bad"), "--tp", "2"]) == 2
    assert "tp=2 needs 2 processes but this run is one" in capsys.readouterr().err
