"""Rewards of completions: the built-in task's (exact match of the answer), a user function ``module:function``,
or a reward-model checkpoint; every result is checked (one finite float per completion) so a broken reward stops
the run with a message naming it, before any update uses it."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence

import torch

from spinwheel.tasks.arithmetic import reward as task_reward

RewardFn = Callable[[list[str], list[str]], Sequence[float]]  # (completions, answers) -> one float each


class RewardError(ValueError):
    """A reward function that failed, or returned something other than one finite float per completion."""


def load_reward_fn(spec: str) -> RewardFn:
    """``"task"`` or ``"module:function"`` (importable from the working directory or the Python path)."""
    if spec == "task":
        return lambda completions, answers: [task_reward(c, a) for c, a in zip(completions, answers)]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"--reward {spec!r}: expected 'task' or 'module:function'")
    import sys

    if "" not in sys.path:
        sys.path.insert(0, "")  # a reward module beside the user's data, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardError(f"--reward {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"--reward {spec!r}: {module_name} has no function {attr!r}")
    return fn


def score(fn: RewardFn, completions: list[str], answers: list[str], name: str = "reward") -> torch.Tensor:
    """Call ``fn`` and check its result: (B,) float32 rewards, or a :class:`RewardError` naming what is wrong."""
    try:
        values = fn(completions, answers)
    except Exception as e:
        raise RewardError(f"the {name} function raised {type(e).__name__}: {e}") from None
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise RewardError(f"the {name} function must return one float per completion ({e})") from None
    if len(values) != len(completions):
        raise RewardError(f"the {name} function returned {len(values)} values for {len(completions)} completions")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardError(
            f"the {name} function returned a non-finite value ({values[bad[0]]}) for completion "
            f"{bad[0]}: {completions[bad[0]]!r}"
        )
    return torch.tensor(values, dtype=torch.float32)
