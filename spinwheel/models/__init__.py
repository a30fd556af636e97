"""Models: the decoder definition, its config, HF checkpoint I/O, tokenizers and built-in presets."""

from spinwheel.models.config import ConfigError, ModelConfig
from spinwheel.models.hf import CheckpointError, load_model, load_state_dict, save_pretrained
from spinwheel.models.presets import PRESETS, preset_config
from spinwheel.models.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from spinwheel.models.transformer import Transformer, token_logprobs

__all__ = [
    "ModelConfig",
    "ConfigError",
    "CheckpointError",
    "Transformer",
    "token_logprobs",
    "load_model",
    "load_state_dict",
    "save_pretrained",
    "PRESETS",
    "preset_config",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]
