"""LLM post-training on spinwheel's own engine and parallel trainer: GRPO, RLOO, REINFORCE++ (:mod:`.loop`)."""

from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.loop import train_rl

__all__ = ["RLConfig", "train_rl"]
