"""A user's RL JSONL as a one-step environment, scored by ``--reward``: the built-in ``task`` reward or a function
``module:function`` in either of two forms, told apart by its signature:

- **TRL's** ``fn(prompts, completions, **columns)`` — a function with a parameter named ``prompts`` or a
  ``**kwargs``. It is called with keywords: ``prompts`` (a plain record's prompt text, a chat record's messages),
  ``completions`` (the text, or for a chat record TRL's ``[{"role": "assistant", "content": text}]``) and every
  other field of the JSONL lines by name, one value per completion (``None`` where a line lacks the field; only the
  fields it names when it takes no ``**kwargs``). ``answer`` is optional for such a function.
- **spinwheel's** ``fn(completions, answers)`` — any other function, called positionally with the texts and the
  lines' answers.

Either way the result is checked as :func:`spinwheel.rl.llm.rewards.score` checks it: one finite float32 number per
completion, or a one-line :class:`~spinwheel.rl.llm.rewards.RewardError` naming the function.

Options (``--env-arg``): ``data`` (the JSONL, required), ``reward`` (``task``), and the held-out split as the
single-turn loop draws it, ``eval_fraction`` (0.05) and ``seed`` (0): a seeded permutation whose first
``max(1, int(n * eval_fraction))`` lines are the test split and the rest the train split. Episode ``seed`` is line
``split[seed % len(split)]``; its first observation is the line's prompt (raw text) or its messages (rendered with
the chat template).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from spinwheel.envs.base import Observation
from spinwheel.envs.single import OneStepEnv, _current
from spinwheel.tasks.data import DataError, RLRecord, check_integer_answers, read_rl_jsonl


def is_trl_style(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is called TRL-style (it has a parameter ``prompts`` or ``**kwargs``), else positionally."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the positional form
        return False
    return any(p.name == "prompts" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def trl_arguments(fn: Callable[..., Any], records: Sequence[RLRecord], texts: list[str]) -> dict[str, Any]:
    """The keyword arguments of a TRL-style call: prompts, completions and the lines' columns (see the docstring)."""
    chat = [r.messages is not None for r in records]
    kwargs: dict[str, Any] = {
        "prompts": [r.messages if c else r.prompt for r, c in zip(records, chat)],
        "completions": [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)],
    }
    names = sorted({key for r in records for key in r.columns} - set(kwargs))
    kwargs.update({key: [r.columns.get(key) for r in records] for key in names})
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {key: value for key, value in kwargs.items() if key in params}
    return kwargs


def record_rewards(
    fn: Callable[..., Any],
    records: Sequence[RLRecord],
    texts: list[str],
    *,
    name: str = "reward",
    timeout_s: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """(B,) float32 rewards of ``texts`` answering ``records``, ``fn`` called in its own form (module docstring)."""
    from spinwheel.rl.llm.rewards import score  # at call time: spinwheel.rl.llm's package imports the RL loop

    if not is_trl_style(fn):
        answers = [r.answer for r in records]
        return score(fn, texts, answers, name, timeout_s=timeout_s, should_stop=should_stop)

    @functools.wraps(fn)  # messages name the user's function (its module and name), not this adapter
    def call(completions: list[str], rows: list[RLRecord]) -> Any:
        return fn(**trl_arguments(fn, rows, completions))

    return score(call, texts, list(records), name, timeout_s=timeout_s, should_stop=should_stop)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=8)
def _load(path: str, stamp: tuple[int, int], reward: str, eval_fraction: float, seed: int):
    """(reward function, train records, test records) of a JSONL, read once per file version and options."""
    from spinwheel.rl.llm.rewards import load_reward_fn  # at call time, as in record_rewards

    fn = load_reward_fn(reward)
    records = read_rl_jsonl(path, require_answer=not is_trl_style(fn))
    if reward == "task":
        check_integer_answers(records)
    if len(records) < 2:
        raise DataError(f"{path}: {len(records)} line(s); an environment needs at least 2 (one train, one test)")
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    num_test = max(1, int(len(records) * eval_fraction))
    return fn, [records[i] for i in order[num_test:]], [records[i] for i in order[:num_test]]


class DatasetEnv(OneStepEnv):
    """One step: a user's RL JSONL (data=PATH) scored by reward=task or module:function (TRL-style too)."""

    name: ClassVar[str] = "dataset"

    def __init__(
        self, split: str = "train", data: str = "", reward: str = "task", eval_fraction: float = 0.05, seed: int = 0
    ) -> None:
        super().__init__(split)
        if not data:
            raise ValueError("the dataset environment needs --env-arg data=PATH (an RL JSONL)")
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        stat = os.stat(data)  # FileNotFoundError names the path
        self.reward_fn, train, test = _load(str(data), (stat.st_mtime_ns, stat.st_size), reward, eval_fraction, seed)
        self.records: list[RLRecord] = train if split == "train" else test
        self.example: RLRecord | None = None

    def reset(self, seed: int) -> Observation:
        self.example = self.records[seed % len(self.records)]
        if self.example.messages is not None:
            return copy.deepcopy(self.example.messages)  # the caller may change its copy
        assert self.example.prompt is not None
        return self.example.prompt

    @classmethod
    def score_batch(cls, envs, texts, *, timeout_s=None, should_stop=None) -> list[float]:
        """One call of each reward function (all episodes of one run share it) over its episodes."""
        rewards = [0.0] * len(envs)
        by_fn: dict[int, list[int]] = {}
        for i, env in enumerate(envs):
            by_fn.setdefault(id(env.reward_fn), []).append(i)
        for rows in by_fn.values():
            fn = envs[rows[0]].reward_fn
            records = [_current(envs[i]) for i in rows]
            values = record_rewards(fn, records, [texts[i] for i in rows], timeout_s=timeout_s, should_stop=should_stop)
            for i, value in zip(rows, values.tolist()):
                rewards[i] = value
        return rewards
