"""The rollout seam: where an RL step's episodes come from (:class:`Rollouts`), and the synchronous loop's
implementation of it (:class:`SyncRollouts`).

The trainer's loop (:class:`~spinwheel.rl.llm.loop.RLJob`) sees only this protocol:

* ``take(step)`` → the step's :class:`Rollout` (its episodes, every rank's, and the seconds spent on them);
* ``publish(version, model)`` → the trainer's weights after ``version`` updates reach whatever samples;
* ``figures()`` → the step's figures of the rollout side (weight sync or broadcast, engine swaps);
* ``evaluate(num)`` → ``num`` held-out greedy episodes on an engine that holds the trainer's current weights (on the
  main rank; None elsewhere);
* ``close()`` at the run's end; ``engine_copy_mb``: the size of an engine copy of the weights (0 when the engine
  serves the trainer's own tensors).

One factory builds them (:func:`~spinwheel.rl.llm.rollouts.rollout_factory.make_rollouts`). The implementations:
:class:`SyncRollouts` (played when the trainer asks, on an engine over the trainer's weights — one per data-parallel
rank, or with ``--engine-tp N`` the tensor-parallel engines of :mod:`~spinwheel.rl.llm.rollouts.engine_tp` as the
layout),
:class:`~spinwheel.rl.llm.rollouts.async_rollouts.RolloutProducer` (``--max-staleness K``: a producer thread ahead of
the
trainer, its engine in this process or a child) and :class:`~spinwheel.rl.llm.rollouts.rollout_ranks.RemoteRollouts`
(``--rollout-ranks R``: ranks of their own generate). Each plays through the run's episode source
(:class:`~spinwheel.rl.llm.rollouts.episode_source.EpisodeSource`: environments, the run's prompts, or an agent's runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from spinwheel.rl.llm.episode_tokens import Episode


@dataclass
class Rollout:
    """One step's episodes and the seconds spent on them: ``generate`` (sampling and environments), ``score``
    (reward calls), and for the producer ``wait_weights`` (it waited for the version it needed) and
    ``wait_rollout`` (the trainer waited for this batch)."""

    step: int
    episodes: list[Episode]
    times: dict[str, float] = field(default_factory=dict)


class Rollouts(Protocol):
    """Where the loop's episodes come from (module docstring)."""

    engine_copy_mb: float

    def take(self, step: int) -> Rollout: ...

    def publish(self, version: int, model: torch.nn.Module) -> None: ...

    def figures(self) -> dict[str, float]: ...

    def evaluate(self, num: int) -> list[Episode] | None: ...

    def close(self) -> None: ...


class Source(Protocol):
    """What plays a step's episodes (:class:`~spinwheel.rl.llm.rollouts.episode_source.EpisodeSource`)."""

    def play(self, step: int, llm: Any, token_versions: Any = None, layout: Any = None) -> tuple[list[Episode], float]:
        """(the step's episodes, every rank's; the seconds this rank spent in reward calls)."""
        ...

    def held_out(self, llm: Any, num: int, layout: Any = None) -> list[Episode]:
        """``num`` greedy test-split episodes, one per task, on this rank alone."""
        ...


class SyncRollouts:
    """The synchronous loop: the step's episodes are played when the trainer asks, on the engine that shares (or
    gathers) the trainer's weights; after the update the engine takes the new weights (``sync``). ``layout``: where
    the episodes are played (None: each data-parallel rank its share; the ``--engine-tp`` engines); its
    ``figures`` are the step's. ``is_main``: this rank evaluates (the others of an engine-TP engine serve it)."""

    engine_copy_mb = 0.0

    def __init__(
        self, source: Source, llm: Any, sync: Callable[[], None], layout: Any = None, is_main: bool = True
    ) -> None:
        self.source, self.llm, self.sync, self.layout, self.is_main = source, llm, sync, layout, is_main

    def take(self, step: int) -> Rollout:
        start = time.perf_counter()
        episodes, score_s = self.source.play(step, self.llm, layout=self.layout)
        return Rollout(step, episodes, {"generate": time.perf_counter() - start - score_s, "score": score_s})

    def publish(self, version: int, model: torch.nn.Module) -> None:
        self.sync()

    def figures(self) -> dict[str, float]:
        return dict(getattr(self.layout, "figures", {}))  # --engine-tp: sync time, peak bytes per rank

    def evaluate(self, num: int) -> list[Episode] | None:
        if not self.is_main:
            if self.layout is not None:
                self.layout.serve_evaluation()  # --engine-tp: rank 0 evaluates on engine 0 (its ranks)
            return None
        return self.source.held_out(self.llm, num, self.layout)

    def close(self) -> None:
        pass


def module_mb(module: torch.nn.Module) -> float:
    """The MiB of a module's parameters (an engine copy's size)."""
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
