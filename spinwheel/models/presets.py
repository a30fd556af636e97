"""Small built-in model sizes, for the embedded tasks and for tests (random weights; nothing is downloaded)."""

from __future__ import annotations

from spinwheel.models.config import ModelConfig

# vocab_size is filled in from the tokenizer when a preset is built for it (the built-in char tokenizer: 100).
PRESETS: dict[str, dict] = {
    # ~0.4M parameters: the demo's model; learns 2-digit addition in a couple of CPU minutes.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    # ~3M parameters.
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    # ~0.05M parameters: unit tests.
    "test": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
}


def preset_config(name: str, vocab_size: int, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` for a tokenizer with ``vocab_size`` tokens."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset '{name}': choose one of {', '.join(PRESETS)} or pass a checkpoint directory"
        )
    return ModelConfig(**{**PRESETS[name], "vocab_size": vocab_size, **overrides})
