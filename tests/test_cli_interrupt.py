"""Ctrl-C as a user sends it, to the real commands in subprocesses: one process, and under torchrun (the signal goes
to the launcher, which forwards it to each worker in turn). Every rank stops after the same step, writes the
(sharded) checkpoint of that step and exits 130 with one line; the checkpoint resumes to the losses of an
uninterrupted run; under ``spinwheel launch`` every training command (sft, grpo, dpo, rm, classic) stops alike.
``spinwheel launch`` passes the workers' status through (130, or 2 for a bad layout, printed once) where torchrun's
own launcher adds a traceback."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.tasks.data import write_jsonl
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.metrics import read_metrics
from spinwheel.train.sft.sft import train_sft
from spinwheel.train.sft.sft_config import SFTConfig

SFT = [
    "--model",
    "test",
    "--steps",
    "5000",
    "--batch-size",
    "8",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
    "--eval-every",
    "0",
    "--eval-examples",
    "4",
    "--max-new-tokens",
    "3",
    "--save-every",
    "0",
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
GRPO = [
    "--model",
    "test",
    "--steps",
    "5000",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "3",
    "--eval-every",
    "0",
    "--eval-examples",
    "2",
    "--save-every",
    "0",
    "--task-num-digits",
    "1",
    "--task-num-train",
    "20",
    "--task-num-test",
    "2",
    "--no-progress",
    "--num-threads",
    "1",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LAUNCH = [sys.executable, "-m", "spinwheel", "launch", "--nproc-per-node", "2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "spinwheel"]


def logged_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def interrupt(
    cmd: list[str], out: Path, after_steps: int = 3, timeout: float = 300, marker: str = '"loss"'
) -> subprocess.CompletedProcess:
    """Run ``cmd``, send SIGINT to it once ``after_steps`` lines holding ``marker`` (steps; ``""``: any line) are
    logged, and return its outcome."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and sum(marker in line for line in metrics.read_text().splitlines()) >= after_steps:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def saved_step(out: Path, world_size: int = 1) -> int:
    """The checkpoint's step, checked to be every rank's (each shard's optimizer-step count and RNG file)."""
    ckpt = out / "checkpoint"
    step = torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"]
    if world_size > 1:
        for r in range(world_size):
            assert torch.load(ckpt / "sharded" / f"rank{r:05d}.pt", weights_only=False)["num_steps"] == step, r
            assert (ckpt / "sharded" / f"rng{r:05d}.pt").is_file()
    return step


def assert_one_message(proc: subprocess.CompletedProcess, step: int, out: Path) -> None:
    line = f"interrupted: checkpoint saved at step {step} in {out / 'checkpoint'}; rerun the same command to resume"
    assert proc.stdout.count("interrupted:") == 1 and line in proc.stdout, proc.stdout + proc.stderr


def reference_losses(tmp_path: Path, steps: int) -> list[float]:
    """The per-step losses of an uninterrupted one-process run of ``SFT`` for ``steps`` steps."""
    out = tmp_path / "reference"
    train_sft(
        SFTConfig(
            model="test",
            out_dir=str(out),
            steps=5000,
            batch_size=8,
            lr=3e-3,
            warmup_steps=2,
            eval_every=0,
            eval_examples=4,
            max_new_tokens=3,
            save_every=0,
            num_threads=1,
            progress=False,
            stop_after=steps,
            task=ArithmeticConfig(num_digits=1, num_train=40, num_test=6),
        )
    )
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow
def test_ctrl_c_in_one_process_saves_the_step_and_resumes_exactly(tmp_path, capfd):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "spinwheel", "sft", *SFT, "--out-dir", str(out)]
    proc = interrupt(cmd, out)
    assert proc.returncode == 130, proc.stderr
    step = saved_step(out)
    assert_one_message(proc, step, out)
    assert "Traceback" not in proc.stderr
    assert logged_steps(out) == list(range(1, step + 1))  # the checkpoint is the last logged step, whole
    resumed = run_cli([*cmd[3:], "--stop-after", "2"], capfd)  # the same command, resumed in this process
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {step} of 5000" in resumed.stdout
    ours = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert ours == reference_losses(tmp_path, step + 2)  # bit-identical across the interruption


TINY_TASK = ["--task-num-digits", "1", "--task-num-train", "20", "--task-num-test", "4", "--no-progress"]
COMMANDS = {
    "sft": [*SFT, "--dp", "2"],
    "grpo": [*GRPO, "--dp", "2"],
    "dpo": ["--model", "test", "--batch-size", "2", "--eval-every", "0", "--data", "{pairs}", *TINY_TASK,
            "--steps", "100000", "--save-every", "0"],
    "rm": ["--model", "test", "--batch-size", "2", "--eval-every", "0", *TINY_TASK, "--steps", "100000",
           "--save-every", "0"],
    "classic": ["--env", "CartPole-v1", "--algo", "ppo", "--num-envs", "2", "--num-steps", "16", "--no-progress",
                "--steps", "100000000"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("command", list(COMMANDS))
def test_ctrl_c_under_spinwheel_launch_saves_and_exits_130(tmp_path, command):
    """SIGINT to ``spinwheel launch --nproc-per-node 2``: every command's ranks stop after the same step, the
    checkpoint (classic: ``policy.pt``) is written and the launcher exits 130 without a traceback. SFT and GRPO:
    every rank's shard holds that step, the log holds every step before it, and SFT's checkpoint resumes (under
    launch) to the losses of an uninterrupted one-process run."""
    rng = random.Random(0)
    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b}0"} for a, b in
             ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(24))]  # fmt: skip
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    out = tmp_path / "run"
    args = [a.replace("{pairs}", str(tmp_path / "pairs.jsonl")) for a in COMMANDS[command]]
    cmd = [*LAUNCH, command, *args, "--out-dir", str(out)]
    if command in ("sft", "grpo"):
        proc = interrupt(cmd, out, after_steps=3 if command == "sft" else 2)
    else:
        proc = interrupt(cmd, out, marker="")  # three lines of the log
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.count("interrupted:") == 1, proc.stdout
    if command == "classic":
        assert (out / "policy.pt").is_file()
        return
    step = load_trainer_state(out / "checkpoint")["step"]
    assert step >= 1 and f"interrupted: checkpoint saved at step {step}" in proc.stdout
    if command not in ("sft", "grpo"):
        return
    assert saved_step(out, world_size=2) == step
    assert_one_message(proc, step, out)
    logged = "loss" if command == "sft" else "reward_mean"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if logged in r] == list(range(1, step + 1))
    if command == "sft":
        assert "SignalException" not in proc.stderr, proc.stderr
        resumed = subprocess.run(cmd + ["--stop-after", "2"], capture_output=True, text=True, env=ENV, timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        ours = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        assert ours == pytest.approx(reference_losses(tmp_path, step + 2), rel=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_ctrl_c_under_torchrun_saves_on_every_rank(tmp_path):
    """torchrun's own launcher: the workers save and exit 130 (torchrun then raises its SignalException)."""
    out = tmp_path / "run"
    proc = interrupt([*TORCHRUN, "sft", *SFT, "--dp", "2", "--out-dir", str(out)], out)
    step = saved_step(out, world_size=2)
    assert_one_message(proc, step, out)
    assert logged_steps(out) == list(range(1, step + 1))


@pytest.mark.slow
@pytest.mark.distributed
def test_bad_layout_is_one_line_once(tmp_path):
    """A layout that does not fit the world: rank 0 says so once; spinwheel launch exits 2 without tracebacks."""
    args = ["sft", "--model", "test", "--tp", "3", "--out-dir", str(tmp_path)]
    proc = subprocess.run([*LAUNCH, *args], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spinwheel sft: error:") and "world of 2" in lines[0], proc.stderr
    proc = subprocess.run([*TORCHRUN, *args], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode != 0 and proc.stderr.count("spinwheel sft: error:") == 1, proc.stderr


def test_one_process_refuses_degrees_and_names_ignored_options(tmp_path, capfd):
    """Without torchrun, --tp 2 is an error that says how to launch; --zero 2 is named in a warning, not dropped."""
    args = ["sft", "--model", "test", "--out-dir", str(tmp_path), "--steps", "1"]
    proc = run_cli([*args, "--tp", "2"], capfd)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "tp=2 needs 2 processes" in proc.stderr and "spinwheel launch --nproc-per-node 2" in proc.stderr
    proc = run_cli([*args, "--zero", "2", "--remat"], capfd)
    assert proc.returncode == 0, proc.stderr
    assert "--zero, --remat: ignored in a one-process run" in proc.stderr, proc.stderr


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of the worker with torchrun's ``RANK=rank`` among the processes (this user's) started after the
    launcher."""
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) > launcher.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b"".join(environ):
            return pid
    return None


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_rank_stops_the_others_with_one_line(tmp_path):
    """SIGKILL one rank of ``spinwheel launch ... sft --dp 2``: the survivor's failed collective becomes one line
    (which rank it is, what failed, how to resume), no traceback, and the launcher exits with the lost rank's
    status."""
    out = tmp_path / "run"
    proc = subprocess.Popen([*LAUNCH, "sft", *SFT, "--dp", "2", "--timeout-s", "30", "--out-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(logged_steps(out) if (out / "metrics.jsonl").exists() else []) < 2:
            time.sleep(0.05)
        pid = _rank_pid(proc, 1)
        assert pid is not None and proc.poll() is None
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 137, stderr
    assert "spinwheel sft: error (rank 0): another rank of this run stopped (" in stderr, stderr
    assert "rerun the same command to resume" in stderr and "Traceback" not in stderr, stderr
