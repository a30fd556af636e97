"""``spinwheel convert``: a GGUF file (llama.cpp's format; a path, or a named model such as
``smollm2-135m-instruct``) written as a plain HF checkpoint directory: float32 safetensors, ``config.json``,
``tokenizer.json`` and the chat template, which ``transformers`` and every spinwheel command load. Commands that take
``--model`` read GGUF files directly (converted once into a cache, :mod:`~spinwheel.models.gguf_cache`); this command
is for keeping the checkpoint somewhere of your choosing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spinwheel.config import option


@dataclass
class ConvertConfig:
    """Convert a GGUF model (quantized weights dequantized to float32) to a plain HF checkpoint directory."""

    model: str | None = option(
        None, help="a .gguf file, a directory holding one, or a named model (smollm2-135m-instruct)"
    )
    out: str | None = option(None, help="directory the checkpoint is written to (new, or empty)")

    def __post_init__(self) -> None:
        if not self.model or not self.out:
            raise ValueError("give --model FILE.gguf and --out DIR")
        out = Path(self.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--out {self.out}: exists and is not an empty directory; choose a new one")


def run_convert(config: ConvertConfig) -> Path:
    """Write the checkpoint; returns its directory."""
    from spinwheel.models.gguf_cache import gguf_source
    from spinwheel.models.gguf_io import GGUFError, convert_gguf

    assert config.model and config.out  # checked by ConvertConfig
    src = gguf_source(config.model)
    if src is None:
        raise GGUFError(f"--model {config.model}: not a .gguf file, a directory holding one, or a named model")
    convert_gguf(src, config.out)
    print(f"spinwheel convert: {src} written as an HF checkpoint to {config.out}", flush=True)
    return Path(config.out)
