"""``spinwheel merge``: a LoRA adapter folded into its base, written as a plain HF checkpoint (PEFT's
``merge_and_unload`` then ``save_pretrained``).

The adapter directory names its base (``base_model_name_or_path``); the base is loaded, each adapted weight becomes
``W + s B A`` (:func:`~spinwheel.models.lora.merge`), and ``config.json``, the safetensors and the tokenizer (the
adapter's, else the base's) are written to ``--out``: a checkpoint ``transformers`` and every spinwheel command load
with no adapter machinery, computing what base + adapter computed (to float rounding). Serving many adapters over one
base without merging is ``spinwheel serve --lora``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spinwheel.config import option


@dataclass
class MergeConfig:
    """Fold a PEFT LoRA adapter into the base it names and write a plain HF checkpoint (config.json, safetensors,
    tokenizer)."""

    model: str | None = option(None, help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    out: str | None = option(None, help="directory the merged checkpoint is written to (new, or empty)")
    dtype: str | None = option(
        None, help="dtype of the written weights: float32, bfloat16, float16 (default: the base's)"
    )

    def __post_init__(self) -> None:
        from spinwheel.models.hf import resolve_dtype
        from spinwheel.models.lora_io import is_adapter_dir

        if not self.model or not self.out:
            raise ValueError("give --model ADAPTER_DIR and --out DIR")
        if not Path(self.model).is_dir():
            raise ValueError(f"--model {self.model}: no such directory; give a LoRA run's checkpoint directory")
        if not is_adapter_dir(self.model):
            raise ValueError(f"--model {self.model}: no adapter_config.json, so no LoRA adapter to merge")
        out = Path(self.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--out {self.out}: exists and is not an empty directory; choose a new one")
        resolve_dtype(self.dtype)


def run_merge(config: MergeConfig) -> Path:
    """Write the merged checkpoint; returns its directory."""
    from spinwheel.models import load_model, load_tokenizer, save_pretrained

    assert config.model and config.out  # checked by MergeConfig
    model = load_model(config.model, dtype=config.dtype, merge_adapter=True)
    save_pretrained(model, config.out, tokenizer=load_tokenizer(config.model))
    print(f"spinwheel merge: {config.model} folded into its base, written to {config.out}", flush=True)
    return Path(config.out)
