"""Training: the SFT trainer, optimizer and schedule, atomic checkpoints, metrics and curves."""

from spinwheel.train.sft import SFTConfig, completion_loss, train_sft

__all__ = ["SFTConfig", "completion_loss", "train_sft"]
