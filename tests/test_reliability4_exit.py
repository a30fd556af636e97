"""A command whose user code (an environment, an agent, a reward function) left a non-daemon thread running still
exits when its work is done, with the command's own exit status and a warning naming the thread (issue 37,
reliability item 1). Run as a real process: what is tested is the interpreter's shutdown."""

from __future__ import annotations

import subprocess
import sys

STICKY_ENV = '''
import threading

from spinwheel.envs import Env, Segment, Step


class Sticky(Env):
    """A one-step environment whose constructor starts a poller that never ends (a non-daemon thread)."""

    def __init__(self, split="train"):
        super().__init__(split)
        if not any(t.name == "sticky-poller" for t in threading.enumerate()):
            threading.Thread(target=threading.Event().wait, name="sticky-poller").start()

    def reset(self, seed):
        return "1+1="

    def step(self, action):
        return Step(None, 1.0, True)

    def expert(self, seed):
        return [Segment("1+1=", False), Segment("2", True)]
'''


def test_a_user_thread_left_running_does_not_keep_the_command_alive(tmp_path):
    (tmp_path / "sticky_env.py").write_text(STICKY_ENV)
    program = [sys.executable, "-m", "spinwheel"]  # the console script runs the same main() (argv from sys.argv)
    argv = [*program, "envs", "expert", "--env", "sticky_env:Sticky", "--num", "2", "--out", "x.jsonl"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "wrote 2 expert episodes of sticky_env:Sticky" in done.stdout  # the work was done and said
    assert len((tmp_path / "x.jsonl").read_text().splitlines()) == 2
    warning = [line for line in done.stderr.splitlines() if "sticky-poller" in line]
    assert len(warning) == 1 and "spinwheel envs: warning" in warning[0], done.stderr


def test_the_exit_status_of_a_failing_command_is_kept(tmp_path):
    (tmp_path / "sticky_env.py").write_text(STICKY_ENV)
    argv = [sys.executable, "-m", "spinwheel", "envs", "expert", "--env", "sticky_env:Sticky", "--num", "0"]
    done = subprocess.run([*argv, "--out", "x.jsonl"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2  # bad input's status, as without the thread
    assert "--num must be >= 1, got 0" in done.stderr and "sticky-poller" in done.stderr
