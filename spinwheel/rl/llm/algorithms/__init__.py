"""The LLM RL algorithms by command name. Adding one: a file with an :class:`~.base.Algorithm` subclass and a
line here; its command, options and help follow from the class."""

from spinwheel.rl.llm.algorithms.base import Algorithm, Parts
from spinwheel.rl.llm.algorithms.cispo import CISPO
from spinwheel.rl.llm.algorithms.grpo import GRPO, RLOO, ReinforcePP
from spinwheel.rl.llm.algorithms.gspo import GSPO
from spinwheel.rl.llm.algorithms.ppo import PPO
from spinwheel.rl.llm.algorithms.trpo import TRPO

ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (GRPO, RLOO, ReinforcePP, PPO, TRPO, GSPO, CISPO)}
# Options that act for some algorithms only; every other RLConfig field is shared by all.
ALGORITHM_OPTIONS = frozenset().union(*(a.options for a in ALGORITHMS.values()))

__all__ = ["ALGORITHMS", "ALGORITHM_OPTIONS", "Algorithm", "Parts"]
