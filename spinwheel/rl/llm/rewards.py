"""Rewards of completions: the built-in task's (exact match of the answer), a user function ``module:function``,
or a reward-model checkpoint. Every call is guarded and every result checked, so a broken reward stops the run with
one line naming the function, before any update uses what it returned:

- the result is one real number per completion (int, float, bool, numpy scalars, or a 1-D numeric array or
  tensor) — a string ``'1.0'``, a dict (whose keys would iterate as rewards) or ``None`` is refused with its index;
- each reward is finite *as float32*, the dtype the loss sees (``1e39`` is a finite double but ``inf`` there);
- an exception in the function, ``sys.exit()`` included, becomes a :class:`RewardError` instead of ending the run;
- with a timeout or a stop hook the call runs on a daemon worker thread, waited on in short slices: past
  ``timeout_s`` it is a :class:`RewardError`, and once ``should_stop()`` is true (a Ctrl-C flag)
  :class:`RewardInterrupted`. A thread cannot be killed: a hung function is left behind and dies with the process.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from spinwheel.tasks.arithmetic import reward as task_reward
from spinwheel.user_code import import_user_module

RewardFn = Callable[[list[str], list[str]], Sequence[float]]  # (completions, answers) -> one number each

WAIT_SLICE_S = 0.05  # how often a waiting score() looks at should_stop and the clock
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # ~3.4e38: a larger reward is inf to the loss


def finite_float32(value: numbers.Real) -> bool:
    """Whether a real number is finite as float32, the dtype the loss sees (``1e39`` is a finite double only)."""
    try:
        return bool(torch.isfinite(torch.tensor(float(value), dtype=torch.float32)))
    except OverflowError:  # an int past float64
        return False


class RewardError(ValueError):
    """A reward function that failed, hung, or returned something other than one finite number per completion."""


class RewardInterrupted(KeyboardInterrupt):
    """The wait for a reward call was stopped because ``should_stop()`` turned true (a Ctrl-C or SIGTERM flag)."""


def task_rewards(completions: list[str], answers: list[str]) -> list[float]:
    """The built-in task's reward of each completion: 1.0 when its final integer equals the answer."""
    return [task_reward(c, a) for c, a in zip(completions, answers)]


def load_reward_fn(spec: str) -> RewardFn:
    """``"task"`` or ``"module:function"`` (importable from the working directory or the Python path)."""
    if spec == "task":
        return task_rewards
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"--reward {spec!r}: expected 'task' or 'module:function'")
    module = import_user_module("--reward", spec, module_name, RewardError)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"--reward {spec!r}: {module_name} has no function {attr!r}")
    return fn


def _label(fn: Callable[..., Any], name: str) -> str:
    """How messages name the function: ``reward function mymod:fn`` (a lambda or closure by ``name`` alone)."""
    if fn is task_rewards:
        return f"{name} function task"
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    return f"{name} function {module}:{qualname}" if module and qualname and "<" not in qualname else f"{name} function"


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _failed(label: str, error: BaseException) -> RewardError:
    if isinstance(error, SystemExit):
        return RewardError(
            f"the {label} called sys.exit({_shown(error.code)}); a reward function must return its rewards"
        )
    text = " ".join(str(error).split())  # one line, whatever the exception's message spans
    return RewardError(f"the {label} raised {type(error).__name__}: {text[:300]}")


def _call(
    fn: RewardFn,
    completions: list[str],
    answers: list[str],
    label: str,
    timeout_s: float | None,
    should_stop: Callable[[], bool] | None,
) -> Any:
    """``fn(completions, answers)``, on a worker thread when there is a timeout or a stop hook to watch."""
    if timeout_s is None and should_stop is None:
        try:
            return fn(completions, answers)
        except (Exception, SystemExit) as e:
            raise _failed(label, e) from None
    outcome: dict[str, Any] = {}
    done = threading.Event()
    grad_enabled = torch.is_grad_enabled()  # grad mode is per thread: the worker runs under the caller's

    def work() -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                outcome["value"] = fn(completions, answers)
        except BaseException as e:  # SystemExit too: a reward ends its own call, never the run
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=work, name=f"spinwheel {label}", daemon=True).start()
    start = time.monotonic()
    while not done.wait(WAIT_SLICE_S):
        if should_stop is not None and should_stop():
            raise RewardInterrupted(f"stopped waiting for the {label}")
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise RewardError(
                f"the {label} did not return within {timeout_s:g} s for {len(completions)} completions "
                "(--reward-timeout-s); make it faster or raise the limit"
            )
    if "error" in outcome:
        raise _failed(label, outcome["error"])
    return outcome["value"]


def _is_number(value: Any) -> bool:
    """A real number: int, float, bool, a numpy number, or a 0-d numeric array or tensor."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.is_complex()
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and value.dtype.kind in "biuf"
    return isinstance(value, (numbers.Real, np.bool_))


def _as_list(values: Any, label: str, num_completions: int) -> list[Any]:
    """The returned container as a list: a list or tuple, or a 1-D numeric numpy array or tensor."""
    if isinstance(values, torch.Tensor):
        if values.is_complex() or values.ndim != 1:
            raise RewardError(
                f"the {label} returned a tensor of shape {tuple(values.shape)} and dtype {values.dtype}; "
                f"it must return one real number per completion ({num_completions})"
            )
        return values.detach().cpu().tolist()
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "biuf" or values.ndim != 1:
            raise RewardError(
                f"the {label} returned an array of shape {values.shape} and dtype {values.dtype}; "
                f"it must return one real number per completion ({num_completions})"
            )
        return values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(
            f"the {label} returned {type(values).__name__}; it must return a list of one number per completion"
        )
    return list(values)


def check_rewards(values: Any, completions: list[str], label: str = "reward function") -> torch.Tensor:
    """``values`` as (B,) float32 rewards, or a :class:`RewardError` naming the first thing wrong and its index."""
    values = _as_list(values, label, len(completions))
    if len(values) != len(completions):
        raise RewardError(f"the {label} returned {len(values)} values for {len(completions)} completions")
    floats = []
    for i, v in enumerate(values):
        if not _is_number(v):
            raise RewardError(
                f"the {label} returned {type(v).__name__} {_shown(v)} at index {i}; rewards must be numbers "
                "(int, float, bool or numpy numbers)"
            )
        try:
            floats.append(float(v))
        except OverflowError:  # an int past float64
            floats.append(float("inf"))
    rewards = torch.tensor(floats, dtype=torch.float32)
    bad = (~torch.isfinite(rewards)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise RewardError(
            f"the {label} returned {_shown(values[i])} at index {i}: a non-finite reward as float32 (rewards must "
            f"be finite numbers within ±3.4e38), for completion {_shown(completions[i])}"
        )
    return rewards


def score(
    fn: RewardFn,
    completions: list[str],
    answers: list[str],
    name: str = "reward",
    *,
    timeout_s: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """Call ``fn`` and check its result: (B,) float32 rewards, or a :class:`RewardError` naming the function and
    what is wrong. ``timeout_s``: the longest the call may take; ``should_stop``: polled while waiting, every
    :data:`WAIT_SLICE_S` seconds — once it returns true the wait ends with :class:`RewardInterrupted`."""
    label = _label(fn, name)
    return check_rewards(_call(fn, completions, answers, label, timeout_s, should_stop), completions, label)
