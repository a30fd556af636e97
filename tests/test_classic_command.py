"""``spinwheel classic`` as a user runs it: the real command in a subprocess (one process and under torchrun).

Ctrl-C saves and exits 130, a rounded ``--steps`` is announced, bad environments and files are one line naming
the fix, ``--eval`` reproduces the figure a run reported, a bad ``--out-dir`` under torchrun fails every rank
at once instead of leaving peers waiting in a collective.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_cli

import spinwheel
from spinwheel.cli import main
from spinwheel.rl.classic import load_policy

ROOT = Path(spinwheel.__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
}
# Many tiny updates: the run is still early when the signal comes, and each update ends quickly.
LONG_RUN = ["--num-envs", "2", "--num-steps", "64", "--update-epochs", "1", "--minibatch-size", "128", "--no-progress"]


def classic(*args: str) -> list[str]:
    return [sys.executable, "-m", "spinwheel.cli", "classic", *args]


def torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "spinwheel.cli",
        "classic",
        *args,
    ]


def run(command: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=timeout)


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def wait_for_updates(proc: subprocess.Popen, out_dir: Path, count: int, timeout: float = 120) -> None:
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.1)
    raise TimeoutError(f"no {count} updates logged within {timeout}s")


INTERRUPTED = re.compile(
    r"interrupted: saved policy\.pt, metrics\.jsonl and learning_curve\.png in (.+) after "
    r"update (\d+) of (\d+) \((\d+) steps\)"
)


def check_interrupted_outputs(out: Path, stdout: str, world_size: int) -> None:
    lines = [line for line in stdout.splitlines() if line.startswith("interrupted:")]
    assert len(lines) == 1, stdout
    match = INTERRUPTED.fullmatch(lines[0])
    assert match and match[1] == str(out), lines[0]
    update, num_updates, steps = int(match[2]), int(match[3]), int(match[4])
    records = read_metrics(out)
    assert update >= 2 and update < num_updates and steps == update * 128
    assert [r["update"] for r in records[:-1]] == list(range(1, update + 1))  # every update before the stop
    last = records[-1]["interrupted"]
    assert (last["updates"], last["env_steps"], last["world_size"]) == (update, steps, world_size)
    assert "eval" not in records[-1] and not (out / "policy.pt.partial").exists()
    policy, _, config = load_policy(out / "policy.pt")
    assert config.num_steps == 64 and sum(p.numel() for p in policy.parameters()) > 0
    assert (out / "learning_curve.png").stat().st_size > 1000


@pytest.mark.slow
def test_ctrl_c_saves_the_policy_and_the_curve_and_exits_130(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        classic("--steps", "1280000", *LONG_RUN, "--out-dir", str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        wait_for_updates(proc, out, 2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and stdout.strip().count("\n") == 0  # one line: 1280000 steps need no note
    check_interrupted_outputs(out, stdout, world_size=1)


@pytest.mark.slow
@pytest.mark.distributed
def test_ctrl_c_under_torchrun_stops_every_rank_at_one_update_and_saves(tmp_path):
    out = tmp_path / "run"
    # Its own session: killpg below is a terminal's Ctrl-C, which reaches torchrun; torchrun forwards it to ranks.
    proc = subprocess.Popen(
        torchrun("--steps", "256000", *LONG_RUN, "--out-dir", str(out), "--dist-timeout-s", "60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )
    try:
        wait_for_updates(proc, out, 2)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.terminate()  # torchrun passes SIGTERM to the ranks and waits for them
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # No rank printed a traceback (torchrun's own SignalException report is torchrun's).
    assert str(ROOT / "spinwheel") not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    check_interrupted_outputs(out, stdout, world_size=2)


@pytest.mark.slow
def test_rounded_steps_are_announced_and_eval_reproduces_the_reported_return(tmp_path, capfd):
    out = tmp_path / "run"
    proc = run_cli(
        [
            "classic",
            "--steps",
            "1500",
            "--num-envs",
            "2",
            "--num-steps",
            "256",
            "--eval-episodes",
            "3",
            "--no-progress",
            "--out-dir",
            str(out),
        ],
        capfd,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    note, evaluation = proc.stdout.strip().splitlines()
    assert note == (
        "note: --steps 1500 is not a multiple of one rollout (num_envs × num_steps = 512); "
        "training 1024 steps (2 updates)"
    )
    assert read_metrics(out)[-2]["env_steps"] == 1024
    reported = evaluation.removeprefix("evaluation: return ")
    assert re.fullmatch(r"\d+\.\d ± \d+\.\d", reported), evaluation
    proc = run_cli(["classic", "--eval", str(out / "policy.pt"), "--eval-episodes", "3"], capfd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    policy_pt = out / "policy.pt"
    assert proc.stdout.strip() == f"evaluation of {policy_pt} (ppo, CartPole-v1): return {reported} over 3 episodes"


def test_unknown_environment_is_one_line_naming_the_fix(capfd):
    proc = run_cli(["classic", "--env", "CartPol-v1"], capfd)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "spinwheel classic: error: unknown gymnasium environment 'CartPol-v1': Environment "
        "`CartPol` doesn't exist. Did you mean: `CartPole`? (list the ids with python -c 'import "
        "gymnasium; gymnasium.pprint_registry()')\n"
    ), proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        pytest.param(
            ["--env", "HalfCheetah-v5"],
            'HalfCheetah-v5 needs MuJoCo, which is not installed; run pip install -e ".[mujoco]"',
            marks=pytest.mark.skipif(importlib.util.find_spec("mujoco") is not None, reason="MuJoCo installed"),
        ),
        (
            ["--eval", str(ROOT / "pyproject.toml")],
            f"{ROOT / 'pyproject.toml'} is not a policy.pt written by spinwheel classic (UnpicklingError",
        ),
        (
            ["--eval", "no-such-policy.pt"],
            "--eval no-such-policy.pt does not exist: give a policy.pt that spinwheel classic wrote",
        ),
    ],
)
def test_missing_mujoco_or_a_bad_policy_file_is_one_line(args, message, capsys):
    assert main(["classic", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"spinwheel classic: error: {message}"), captured.err


@pytest.mark.slow
@pytest.mark.distributed
def test_bad_out_dir_under_torchrun_fails_every_rank_at_once(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    start = time.monotonic()
    proc = run(
        torchrun(
            "--steps",
            "512",
            "--num-envs",
            "2",
            "--num-steps",
            "256",
            "--no-progress",
            "--out-dir",
            str(blocker / "run"),
        ),
        timeout=90,
    )
    assert time.monotonic() - start < 60  # the peers do not wait for the 300 s collective timeout
    assert proc.returncode != 0
    assert proc.stderr.count("spinwheel classic: error:") == 1 and "Not a directory" in proc.stderr, proc.stderr
    assert blocker.read_text() == "not a directory"
