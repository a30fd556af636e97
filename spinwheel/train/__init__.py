"""Training: learners (single-process reference and the parallel trainer), the SFT loop and its parts, optimizer
and schedule, atomic checkpoints, metrics and curves."""

from spinwheel.train.sft.sft import train_sft
from spinwheel.train.sft.sft_config import SFTConfig
from spinwheel.train.sft.sft_data import completion_loss

__all__ = ["SFTConfig", "completion_loss", "train_sft"]
