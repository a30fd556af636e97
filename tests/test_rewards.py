"""Reward calls: numbers only, finite as float32, exceptions and ``sys.exit`` as one-line errors naming the
function, a timeout, and a stop hook that a Ctrl-C flag ends the wait with."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.rewards import RewardError, RewardInterrupted, load_reward_fn, score

COMPLETIONS, ANSWERS = ["a", "b"], ["", ""]
RELEASE = threading.Event()  # lets the hung functions' worker threads finish after their test


def returns_strings(completions, answers):
    return ["1.0", "0"]


def returns_dict(completions, answers):
    return {0.5: "a", 1.0: "b"}


def returns_none_inside(completions, answers):
    return [1.0, None]


def returns_huge(completions, answers):
    return [0.0, 1e39]  # a finite double; inf as float32


def returns_huge_int(completions, answers):
    return [10**400, 0]


def exits(completions, answers):
    sys.exit(0)


def hangs(completions, answers):
    RELEASE.wait(30)
    return [0.0] * len(completions)


def grad_mode(completions, answers):
    return [float(torch.is_grad_enabled())] * len(completions)


@pytest.fixture(autouse=True)
def _release_hung_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("timeout_s", [None, 10.0])  # called in place, and on the worker thread
@pytest.mark.parametrize(
    "fn, message",
    [
        (returns_strings, r"returns_strings returned str '1.0' at index 0; rewards must be numbers"),
        (returns_dict, r"returns_dict returned dict; it must return a list of one number per completion"),
        (returns_none_inside, r"returns_none_inside returned NoneType None at index 1; rewards must be numbers"),
        (returns_huge, r"returns_huge returned 1e\+39 at index 1: a non-finite reward as float32"),
        (returns_huge_int, r"returns_huge_int returned 1000+\.\.\. at index 0: a non-finite reward as float32"),
        (exits, r"^the reward function .*:exits called sys.exit\(0\); a reward function must return its rewards$"),
    ],
)
def test_bad_rewards_are_one_line_errors_naming_the_function(fn, message, timeout_s):
    with pytest.raises(RewardError) as error:
        score(fn, COMPLETIONS, ANSWERS, timeout_s=timeout_s)
    assert re.search(message, one_line(error)), str(error.value)
    assert "reward function" in str(error.value)


@pytest.mark.parametrize(
    "values",
    [
        [1, 0.5],
        [True, False],
        (np.float32(1.0), np.int64(0)),
        [np.bool_(True), np.array(0.5)],
        np.array([1.0, 0.5]),
        np.array([1, 0], dtype=np.int8),
        torch.tensor([1.0, 0.5]),
        [torch.tensor(1.0), 0],
    ],
)
def test_numbers_of_every_kind_are_accepted(values):
    rewards = score(lambda c, a: values, COMPLETIONS, ANSWERS)
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == [float(v) for v in values]


@pytest.mark.parametrize("values", [np.array(["1", "0"]), np.array([[1.0], [0.0]]), torch.tensor([1j, 0j])])
def test_arrays_of_other_kinds_or_shapes_are_refused(values):
    with pytest.raises(RewardError, match="one real number per completion"):
        score(lambda c, a: values, COMPLETIONS, ANSWERS)


def test_a_reward_that_never_returns_times_out():
    start = time.monotonic()
    with pytest.raises(RewardError) as error:
        score(hangs, COMPLETIONS, ANSWERS, timeout_s=0.3)
    assert time.monotonic() - start < 5
    assert re.search(r"function .*:hangs did not return within 0.3 s .*--reward-timeout-s", one_line(error))


def test_a_stop_flag_ends_the_wait():
    deadline = time.monotonic() + 0.3
    start = time.monotonic()
    with pytest.raises(RewardInterrupted):
        score(hangs, COMPLETIONS, ANSWERS, timeout_s=None, should_stop=lambda: time.monotonic() > deadline)
    assert time.monotonic() - start < 5


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_ctrl_c_that_sets_a_flag_stops_a_hung_reward():
    """What the run harness does: SIGINT only sets a flag; the wait for the reward polls it."""
    flag: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.append(signum))
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        start = time.monotonic()
        with pytest.raises(RewardInterrupted):
            score(hangs, COMPLETIONS, ANSWERS, timeout_s=300.0, should_stop=lambda: bool(flag))
        assert time.monotonic() - start < 5 and flag == [signal.SIGINT]
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


def test_the_worker_thread_runs_under_the_callers_grad_mode():
    with torch.no_grad():
        assert score(grad_mode, COMPLETIONS, ANSWERS, timeout_s=10.0).tolist() == [0.0, 0.0]
    assert score(grad_mode, COMPLETIONS, ANSWERS, timeout_s=10.0).tolist() == [1.0, 1.0]


def test_exceptions_name_the_function_and_the_task_reward_is_named_task(tmp_path, monkeypatch):
    (tmp_path / "badrewards.py").write_text("def boom(c, a):\n    raise RuntimeError('bad\\nthing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"^the reward function badrewards:boom raised RuntimeError: bad thing$"):
        score(load_reward_fn("badrewards:boom"), COMPLETIONS, ANSWERS, timeout_s=10.0)
    with pytest.raises(RewardError, match="^the reward function task raised ValueError: reward"):
        score(load_reward_fn("task"), ["1"], ["one"])


def test_a_reward_module_that_exits_at_import_is_an_option_error(tmp_path, monkeypatch):
    (tmp_path / "exitingrewards.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="cannot import 'exitingrewards' \\(SystemExit: 0\\)"):
        load_reward_fn("exitingrewards:f")


def test_reward_timeout_option():
    assert RLConfig().reward_timeout_s == 300.0
    assert RLConfig(reward_timeout_s=None).reward_timeout_s is None
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--reward-timeout-s must be a number of seconds > 0"):
            RLConfig(reward_timeout_s=bad)
