"""The run harness every training command runs on: one run per output directory (a lock, never stale), nothing
broken ever saved (non-finite figures or parameters stop the run; the last good checkpoint stays the latest), a
failing reward saves the steps before it, and Ctrl-C stops a reward that hangs (Ctrl-C under ``spinwheel launch``
for every command: test_cli_interrupt.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from spinwheel.models.hf import load_model
from spinwheel.train.checkpoint import load_trainer_state
from spinwheel.train.learners import LocalLearner, OptimConfig
from spinwheel.train.run import NonFiniteError, Run
from spinwheel.train.run_dir import LOCK_FILE, RunDirError, RunDirLock
from spinwheel.train.sft.sft_config import SFTConfig

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SPINWHEEL = [sys.executable, "-m", "spinwheel"]
TINY_TASK = ["--task-num-digits", "1", "--task-num-train", "20", "--task-num-test", "4", "--no-progress"]


# ---- one run per directory ----------------------------------------------------------------------------------------


def test_a_second_run_on_the_same_directory_fails_naming_the_holder(tmp_path):
    with RunDirLock(tmp_path / "run"):
        with pytest.raises(RunDirError, match=rf"in use by another run \(pid {os.getpid()}\)"):
            RunDirLock(tmp_path / "run").acquire()
    with RunDirLock(tmp_path / "run"):  # released on exit: the next run takes it
        pass
    assert not (tmp_path / "run" / LOCK_FILE).exists()  # a finished run leaves no trace


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_not_stale(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "from spinwheel.train.run_dir import RunDirLock; import sys, time; "
         "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
        RunDirLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    RunDirLock(tmp_path).acquire().release()  # the kernel dropped the dead process's lock


def test_out_dir_that_is_a_file_is_one_line(tmp_path, capfd):
    (tmp_path / "f").write_text("x")
    proc = run_cli(["sft", "--model", "test", "--steps", "1", "--out-dir", str(tmp_path / "f"), "--no-progress"], capfd)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"spinwheel sft: error: --out-dir {tmp_path / 'f'} is a file; choose a directory"
    ]


def test_a_refused_run_leaves_no_empty_out_dir_and_an_uncreatable_one_is_named(tmp_path, capfd):
    out = tmp_path / "never"
    proc = run_cli(["sft", "--model", str(tmp_path / "no-such-model"), "--steps", "1", "--out-dir", str(out)], capfd)
    assert proc.returncode == 2 and not out.exists()  # refused when loading the model: the directory it made is gone
    (tmp_path / "file").write_text("x")  # a parent that is a file: mkdir fails (as root too)
    proc = run_cli(["sft", "--model", "test", "--steps", "1", "--out-dir", str(tmp_path / "file" / "run")], capfd)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"--out-dir {tmp_path / 'file' / 'run'} cannot be created or written" in proc.stderr


@pytest.mark.slow
def test_two_sft_commands_on_one_directory(tmp_path, capfd):
    """The second command (in this process) fails at once with one line naming the first's pid; the first run's log
    stays whole."""
    out = tmp_path / "run"
    args = ["sft", "--model", "test", "--steps", "400", "--eval-every", "0", "--save-every", "0"]
    args += [*TINY_TASK, "--num-threads", "1", "--out-dir", str(out)]
    first = subprocess.Popen([*SPINWHEEL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = run_cli(args, capfd)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"spinwheel sft: error: --out-dir {out} is in use by another run (pid {first.pid}); wait for it to end "
            "or choose another --out-dir"
        ]
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    steps = [r for r in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in r]
    assert [int(r.split('"step": ')[1].split(",")[0]) for r in steps] == list(range(1, len(steps) + 1))


# ---- nothing broken is saved --------------------------------------------------------------------------------------


class _Job:
    """A harness job on a tiny model whose step ``bad_step`` goes wrong in the way ``how`` says."""

    def __init__(self, run: Run, bad_step: int, how: str) -> None:
        self.run, self.bad_step, self.how = run, bad_step, how
        self.learner = LocalLearner(load_model("test", seed=0), OptimConfig(1e-3))
        run.open_log(True)

    def step(self, step: int) -> dict:
        loss = 1.0
        if step == self.bad_step and self.how == "loss":
            loss = float("nan")
        if step == self.bad_step and self.how == "param":
            with torch.no_grad():
                next(self.learner.model.parameters())[0, 0] = float("inf")
        return {"loss": loss, "grad_norm": 0.5}

    def evaluate(self, step: int) -> None:
        return None

    def save(self, ckpt_dir: Path, state: dict) -> None:
        self.learner.save(ckpt_dir, None, state)


@pytest.mark.parametrize("how", ["loss", "param"])
def test_a_non_finite_step_stops_without_saving(tmp_path, how):
    config = SFTConfig(model="test", out_dir=str(tmp_path), steps=10, save_every=2, eval_every=0, progress=False)
    with Run(config, False, "test") as run:
        with pytest.raises(NonFiniteError) as e:
            run.train(_Job(run, bad_step=4, how=how), [("loss", "loss")], "t")  # 0-based: the 5th step
    assert load_trainer_state(tmp_path / "checkpoint")["step"] == 4  # the last good one stays the latest
    if how == "loss":
        assert str(e.value).startswith("step 5: loss = nan is not finite; the run stopped without saving")
    else:  # found when step 6's checkpoint was due: nothing written
        assert str(e.value).startswith("step 6: a parameter is not finite; the run stopped without saving")
    assert f"the last good checkpoint ({tmp_path / 'checkpoint'}, step 4) stays the latest" in str(e.value)
    assert torch.isfinite(load_model(tmp_path / "checkpoint").lm_head.weight).all()


def test_a_save_killed_between_its_renames_is_put_back(tmp_path, capsys):
    """A process killed after moving the previous checkpoint aside and before moving the new one in leaves no
    ``checkpoint/``: the next run puts the previous one back and resumes from it instead of starting over."""
    config = SFTConfig(model="test", out_dir=str(tmp_path), steps=4, save_every=2, eval_every=0, progress=False)
    with Run(config, False, "test") as run:
        run.train(_Job(run, bad_step=-1, how="none"), [("loss", "loss")], "t")
    (tmp_path / "checkpoint").rename(tmp_path / ".checkpoint.old-4242")  # the window between the two renames
    (tmp_path / ".checkpoint.tmp-abc").mkdir()  # the new one, not finished
    with Run(dataclasses.replace(config, steps=6, force=True), False, "test") as run:
        assert run.resumed and run.start_step == 4
    assert "put back from .checkpoint.old-4242" in capsys.readouterr().out
    assert load_trainer_state(tmp_path / "checkpoint")["step"] == 4


def _grpo(tmp_path: Path, reward: str) -> list[str]:
    """A short ``spinwheel grpo`` command with ``--reward reward`` (a module in ``tmp_path``), writing tmp_path/run."""
    args = ["grpo", "--model", "test", "--steps", "10", "--prompts-per-step", "2", "--group-size", "2"]
    args += ["--max-new-tokens", "2", "--eval-every", "0", "--save-every", "0", "--eval-examples", "2", *TINY_TASK]
    return [*SPINWHEEL, *args, "--reward", reward, "--out-dir", str(tmp_path / "run")]


# Call 1 scores the evaluation at step 0 (evaluation uses the run's own reward), calls 2 and 3 steps 1 and 2.
REWARD = """
calls = 0
def fn(completions, answers):
    global calls
    calls += 1
    if calls == 4:
        raise RuntimeError("the grader is down")
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_a_reward_that_raises_saves_the_steps_before_it(tmp_path, capfd, monkeypatch):
    (tmp_path / "flaky_reward.py").write_text(REWARD)
    cmd = _grpo(tmp_path, "flaky_reward:fn")
    # In this process, from tmp_path as the command's working directory; sys.path and the module are put back.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "flaky_reward", raising=False)
    proc = run_cli(cmd[len(SPINWHEEL) :], capfd)
    sys.modules.pop("flaky_reward", None)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "the grader is down" in proc.stderr
    assert f"checkpoint saved at step 2 in {tmp_path / 'run' / 'checkpoint'}" in proc.stdout
    assert load_trainer_state(tmp_path / "run" / "checkpoint")["step"] == 2


# ---- Ctrl-C --------------------------------------------------------------------------------------------------------
# Under ``spinwheel launch``, every command alike: tests/test_cli_interrupt.py (one launch of each command).

HANGING_REWARD = """
import time
calls = 0
def fn(completions, answers):
    global calls
    calls += 1
    if calls == 4:
        print("hanging", flush=True)
        time.sleep(1000)
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_ctrl_c_stops_a_hanging_reward_and_saves_the_steps_before_it(tmp_path):
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    proc = subprocess.Popen(
        _grpo(tmp_path, "hanging_reward:fn"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )
    assert proc.stdout.readline().strip() == "hanging"  # step 3's reward call never returns
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert f"interrupted: checkpoint saved at step 2 in {tmp_path / 'run' / 'checkpoint'}" in stdout
    assert load_trainer_state(tmp_path / "run" / "checkpoint")["step"] == 2
