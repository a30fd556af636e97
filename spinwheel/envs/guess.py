"""``guess``: find a hidden number in 1..n from "higher" / "lower" hints, in at most ``max_turns`` (K) guesses.

An episode (n = 16)::

    guess 1-16\\n    the first observation
    8\\n             the model's guess; the turn ends at the stop string "\\n"
    higher\\n        the environment's hint ("lower\\n"; "?\\n" for a turn without a number)
    12\\n
    lower\\n
    10\\n            found: the episode ends (done, no further observation)

Reward: found at guess t ≤ K earns ``1 − (t − 1) / K`` (1 for the first guess, 1/K for the K-th), not found 0 — so
finding it at all is the main signal and every guess saved adds 1/K. ``info``: ``turns``, ``found``. The expert
bisects (lower middle first), so it finds any number within ⌈log2(n + 1)⌉ guesses (5 for n = 16; K defaults to 6).
The hidden number of episode ``seed`` is drawn from ``random.Random("guess:<split>:<seed>")``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import ClassVar

from spinwheel.envs.base import Action, Env, Segment, Step

_NUMBER = re.compile(r"-?\d+")


class GuessEnv(Env):
    """Multi-turn: find a hidden number in 1..n from higher / lower hints within max_turns guesses."""

    name: ClassVar[str] = "guess"
    max_turns: ClassVar[int] = 6
    stop: ClassVar[Sequence[str]] = ("\n",)

    def __init__(self, split: str = "train", n: int = 16, max_turns: int = 6) -> None:
        super().__init__(split)
        for key, value, high in (("n", n, 10**6), ("max_turns", max_turns, 64)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"{key} must be an integer in 1..{high}, got {value!r}")
        self.n = n
        self.max_turns = max_turns  # type: ignore[misc]  # this instance's K
        self.target: int | None = None
        self.turns = 0

    def hidden(self, seed: int) -> int:
        """The number episode ``seed`` of this split hides."""
        return random.Random(f"guess:{self.split}:{seed}").randint(1, self.n)

    def reset(self, seed: int) -> str:
        self.target, self.turns = self.hidden(seed), 0
        return f"guess 1-{self.n}\n"

    def reward(self, turns: int) -> float:
        """The reward of finding the number at guess ``turns``."""
        return 1.0 - (turns - 1) / self.max_turns

    def step(self, action: Action) -> Step:
        if self.target is None:
            raise RuntimeError("GuessEnv.step before reset")
        self.turns += 1
        match = _NUMBER.search(action.text)
        guess = int(match.group()) if match and len(match.group()) <= 12 else None
        if guess == self.target:
            return Step(None, self.reward(self.turns), True, {"turns": float(self.turns), "found": 1.0})
        if self.turns >= self.max_turns:
            return Step(None, 0.0, True, {"turns": float(self.turns), "found": 0.0})
        hint = "?\n" if guess is None else ("higher\n" if guess < self.target else "lower\n")
        return Step(hint, 0.0, False, {"turns": float(self.turns), "found": 0.0})

    def expert(self, seed: int) -> list[Segment]:
        """Bisection: guess the middle of what is left, narrow by the hint."""
        target, low, high = self.hidden(seed), 1, self.n
        segments = [Segment(f"guess 1-{self.n}\n", model=False)]
        while True:
            guess = (low + high) // 2
            segments.append(Segment(f"{guess}\n", model=True))
            if guess == target:
                return segments
            low, high = (guess + 1, high) if guess < target else (low, guess - 1)
            segments.append(Segment("higher\n" if guess < target else "lower\n", model=False))
