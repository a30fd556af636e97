"""What an environment is to spinwheel's RL loop: Gym-shaped, as OpenEnv, GEM and skyrl-gym are.

An episode: ``reset(seed)`` gives the first observation (the prompt), then the model and the environment take turns:
the model's turn is an :class:`Action` (its text and the exact token ids it sampled), ``step(action)`` answers with
a :class:`Step` — the next observation, the turn's reward, whether the episode is done, and ``info`` (figures to
log). An observation is raw text (appended to the episode's tokens as it is tokenized) or a list of chat messages
(rendered with the checkpoint's chat template).

The rollout keeps each episode as one token sequence: the prompt's tokens, then per turn the sampled tokens (trained
on: loss mask 1) and the observation's tokens (not trained on: mask 0). Nothing the model sampled is ever
re-tokenised.

An environment class is built once per episode with the run's ``--env-arg`` options as keyword arguments and
``split`` ("train" or "test": held-out evaluation resets test-split environments). Single-turn tasks are one-step
environments: ``step`` scores the answer and returns ``done=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

SPLITS: tuple[str, ...] = ("train", "test")

Message = dict[str, str]  # {"role": ..., "content": ...}
Observation = str | list[Message]  # raw text, or chat messages rendered with the chat template


@dataclass
class Segment:
    """A piece of an episode's text: the model's (``model=True``: trained on) or the environment's."""

    text: str
    model: bool


class EnvError(ValueError):
    """An environment that cannot be loaded or built, named with the cause and what to do (one line)."""


@dataclass
class Action:
    """The model's turn: its text (decoded from the sampled tokens) and the token ids it sampled."""

    text: str
    token_ids: list[int]


@dataclass
class Step:
    """What the environment answers to a turn. ``observation`` is None when ``done``."""

    observation: Observation | None
    reward: float
    done: bool
    info: dict[str, float] = field(default_factory=dict)


class Env:
    """The interface (subclass it, or provide the same methods and attributes)."""

    name: ClassVar[str] = ""
    max_turns: ClassVar[int] = 1  # model turns per episode at most (the run's --max-turns may lower it)
    stop: ClassVar[Sequence[str]] = ()  # strings that end the model's turn besides EOS (kept in the action's text)

    def __init__(self, split: str = "train", **options: Any) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.split = split

    def reset(self, seed: int) -> Observation:
        """The first observation of the episode that ``seed`` picks (the same seed: the same episode)."""
        raise NotImplementedError

    def step(self, action: Action) -> Step:
        raise NotImplementedError

    def expert(self, seed: int) -> list[Segment] | None:
        """A scripted expert's episode for ``seed`` (SFT demonstrations), where the environment has one: the
        episode's text in order — the first observation, then the turns and observations — each segment marked
        whether it is the model's (trained on) or the environment's; None where there is no expert."""
        return None
