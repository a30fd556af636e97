"""spinwheel: a compact LLM post-training stack — policy-gradient RL, distributed training and a paged-attention
serving engine, on PyTorch."""

from spinwheel.engine import LLM, EngineConfig, SamplingParams
from spinwheel.models import (
    ModelConfig,
    Tokenizer,
    Transformer,
    load_model,
    load_tokenizer,
    save_pretrained,
    token_logprobs,
)

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "EngineConfig",
    "SamplingParams",
    "ModelConfig",
    "Tokenizer",
    "Transformer",
    "load_model",
    "load_tokenizer",
    "save_pretrained",
    "token_logprobs",
]
