"""The LLM RL algorithms by command name. Adding one: a file with an :class:`~.base.Algorithm` subclass and a
line here; its command, options and help follow from the class."""

from spinwheel.rl.llm.algorithm_options import ALGORITHM_OPTIONS, OPTIONS
from spinwheel.rl.llm.algorithms.base import Algorithm, Parts
from spinwheel.rl.llm.algorithms.cispo import CISPO
from spinwheel.rl.llm.algorithms.grpo import GRPO, RLOO, ReinforcePP
from spinwheel.rl.llm.algorithms.gspo import GSPO
from spinwheel.rl.llm.algorithms.ppo import PPO
from spinwheel.rl.llm.algorithms.trpo import TRPO

ALGORITHMS: dict[str, type[Algorithm]] = {a.name: a for a in (GRPO, RLOO, ReinforcePP, PPO, TRPO, GSPO, CISPO)}
assert ALGORITHMS.keys() == OPTIONS.keys()  # each algorithm's options are declared in algorithm_options.py

__all__ = ["ALGORITHMS", "ALGORITHM_OPTIONS", "Algorithm", "Parts"]
