"""The process group that a run's own collectives span (agreement on a signal or a failure, checkpoint barriers):
the whole ``torchrun`` world (``None``, the default), or — when some ranks do other work, as the rollout ranks of
``--rollout-ranks`` (:mod:`spinwheel.rl.llm.rollouts.rollout_ranks`) — the group of the ranks that train, set once by
the
run before its first collective. Global ranks are unchanged: rank 0 is still the main rank.
"""

from __future__ import annotations

_GROUP: object | None = None


def run_group() -> object | None:
    """The group for the run's collectives (``None``: the default group, the whole world)."""
    return _GROUP


def set_run_group(group: object | None) -> None:
    global _GROUP
    _GROUP = group
