"""Small built-in model sizes, for the embedded tasks and for tests (random weights; nothing is downloaded)."""

from __future__ import annotations

from spinwheel.models.config import ModelConfig

# One row a preset, one column a ModelConfig field. vocab_size is filled in from the tokenizer when a preset is
# built for it (the built-in char tokenizer: 100).
_COLUMNS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
)
_ROWS = {
    "tiny": (128, 352, 3, 4, 2, 256, True),  # ~0.4M parameters: the demo's model; learns 2-digit addition in minutes
    "small": (256, 704, 6, 8, 4, 1024, True),  # ~3M parameters
    "test": (32, 64, 2, 4, 2, 128, False),  # ~0.05M parameters: unit tests
}
PRESETS: dict[str, dict] = {name: dict(zip(_COLUMNS, row, strict=True)) for name, row in _ROWS.items()}


def preset_config(name: str, vocab_size: int, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` for a tokenizer with ``vocab_size`` tokens."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset '{name}': choose one of {', '.join(PRESETS)} or pass a checkpoint directory"
        )
    return ModelConfig(**{**PRESETS[name], "vocab_size": vocab_size, **overrides})
