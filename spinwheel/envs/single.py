"""One-step environments: today's single-turn tasks on the environment interface, and scoring many episodes at once.

A one-step environment's ``reset(seed)`` picks the example (the prompt is the first observation) and its one
``step`` scores the model's answer and ends the episode (``done=True``). Scoring one episode at a time would call a
user's reward function once per completion; :func:`step_batch` instead scores every one-step episode of one class in
one call of :meth:`OneStepEnv.score_batch` (a reward function sees the whole rollout, as the single-turn loop's
``score`` does) and steps any other environment one by one.

The built-in ``arithmetic`` environment serves :class:`~spinwheel.tasks.arithmetic.ArithmeticTask`'s splits:
episode ``seed`` is example ``split[seed % len(split)]``, its prompt the raw text (``"12+34="``) the single-turn
rollout tokenizes with BOS, its reward the task's (1.0 when the final integer of the answer is right).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from spinwheel.envs.base import Action, Env, Segment, Step
from spinwheel.tasks.arithmetic import ArithmeticConfig, ArithmeticTask, Example
from spinwheel.tasks.arithmetic import reward as task_reward


class OneStepEnv(Env):
    """An environment whose episode is one model turn, scored by :meth:`score_batch` (one call for many)."""

    max_turns: ClassVar[int] = 1

    def step(self, action: Action) -> Step:
        return self.step_batch([self], [action])[0]

    @classmethod
    def step_batch(
        cls,
        envs: Sequence[OneStepEnv],
        actions: Sequence[Action],
        *,
        timeout_s: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Step]:
        """The final steps of ``envs`` (each reset, all of this class) answered by ``actions``, scored in one call."""
        texts = [a.text for a in actions]
        rewards = cls.score_batch(envs, texts, timeout_s=timeout_s, should_stop=should_stop)
        return [Step(None, r, True, env.info(r)) for env, r in zip(envs, rewards)]

    @classmethod
    def score_batch(
        cls,
        envs: Sequence[OneStepEnv],
        texts: list[str],
        *,
        timeout_s: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[float]:
        """One reward per episode: ``texts[i]`` is the answer to ``envs[i]``'s current episode."""
        raise NotImplementedError

    def info(self, reward: float) -> dict[str, float]:
        """The figures logged for an episode that earned ``reward`` (none by default)."""
        return {}


def step_batch(
    envs: Sequence[Env],
    actions: Sequence[Action],
    *,
    timeout_s: float | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[Step]:
    """``[env.step(action) ...]`` in order, the episodes of each class with a ``step_batch`` classmethod (one-step
    environments: :meth:`OneStepEnv.step_batch`) stepped in one call of it — ``timeout_s`` and ``should_stop`` reach
    a user's reward function as in :func:`spinwheel.rl.llm.rewards.score`; a failing reward fails the call
    (:class:`RewardError`)."""
    if len(envs) != len(actions):
        raise ValueError(f"step_batch got {len(envs)} environments and {len(actions)} actions")
    steps: list[Step | None] = [None] * len(envs)
    by_class: dict[type, list[int]] = {}
    for i, env in enumerate(envs):
        if callable(getattr(type(env), "step_batch", None)):
            by_class.setdefault(type(env), []).append(i)
        else:
            steps[i] = env.step(actions[i])
    for cls, rows in by_class.items():
        done = cls.step_batch(  # type: ignore[attr-defined]
            [envs[i] for i in rows], [actions[i] for i in rows], timeout_s=timeout_s, should_stop=should_stop
        )
        for i, step in zip(rows, done):
            steps[i] = step
    return steps  # type: ignore[return-value]


@functools.lru_cache(maxsize=8)
def _task(num_digits: int, operators: tuple[str, ...], num_train: int, num_test: int, seed: int) -> ArithmeticTask:
    """The task's splits, built once per configuration (an environment is built once per episode)."""
    return ArithmeticTask(ArithmeticConfig(num_digits, operators, num_train, num_test, seed))


def parse_operators(operators: Any) -> tuple[str, ...]:
    """``"+"``, ``"+-*"``, ``"+,-"`` or a tuple, as the task's tuple of operators."""
    if isinstance(operators, str):
        return tuple(op for op in operators.replace(",", "").replace(" ", ""))
    return tuple(operators)


class ArithmeticEnv(OneStepEnv):
    """One step: the built-in arithmetic task (the options of --task-*), scored by exact match."""

    name: ClassVar[str] = "arithmetic"

    def __init__(
        self,
        split: str = "train",
        num_digits: int = 2,
        operators: str = "+",
        num_train: int = 8000,
        num_test: int = 500,
        seed: int = 0,
    ) -> None:
        super().__init__(split)
        task = _task(num_digits, parse_operators(operators), num_train, num_test, seed)
        self.examples: list[Example] = task.train if split == "train" else task.test
        self.example: Example | None = None

    def reset(self, seed: int) -> str:
        self.example = self.examples[seed % len(self.examples)]
        return self.example.prompt

    @classmethod
    def score_batch(cls, envs, texts, *, timeout_s=None, should_stop=None) -> list[float]:
        return [task_reward(text, _current(env).answer) for env, text in zip(envs, texts)]  # rewards.task_rewards'

    def info(self, reward: float) -> dict[str, float]:
        return {"correct": reward}

    def expert(self, seed: int) -> list[Segment]:
        example = self.examples[seed % len(self.examples)]
        return [Segment(example.prompt, model=False), Segment(example.answer, model=True)]


def _current(env: Any) -> Any:
    """The example ``env`` was last reset to."""
    if env.example is None:
        raise RuntimeError(f"{type(env).__name__}.step before reset")
    return env.example
