"""What Hugging Face's files look like, shared by full checkpoints (:mod:`~spinwheel.models.hf`) and LoRA adapters
(:mod:`~spinwheel.models.lora_io`): tensor names (``model.`` + spinwheel's name; a sequence classifier's head is
``score.``) and the file modes a written file gets (safetensors writes 0600; a checkpoint gets what the umask
gives)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

HF_PREFIX = "model."
SCORE_PREFIX = "score."  # the output layer of HF's *ForSequenceClassification


def hf_key(name: str, scalar_head: bool = False) -> str:
    """spinwheel parameter name -> HF name (``layers.0.mlp.up_proj.weight`` -> ``model.layers.0...``; the output
    layer is ``lm_head.weight``, or ``score.weight`` for a scalar head)."""
    if name.startswith("lm_head."):
        return SCORE_PREFIX + name[len("lm_head.") :] if scalar_head else name
    return HF_PREFIX + name


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or key and what was expected."""


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike) -> Iterator[Any]:
    """``safe_open`` of a checkpoint's safetensors file (PyTorch tensors); a file that is not one — truncated, a
    partial download, another format — is a :class:`CheckpointError` naming the file and what to do, not a
    library traceback."""
    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({e}); it may be truncated or a partial copy: save or download "
            "the checkpoint again"
        ) from None
    with handle as sf:
        yield sf


def our_name(key: str) -> str:
    """HF tensor name -> spinwheel's (inverse of :func:`hf_key`)."""
    name = key[len(HF_PREFIX) :] if key.startswith(HF_PREFIX) else key
    if name.startswith(SCORE_PREFIX):  # a sequence classifier's head is our output layer
        name = "lm_head." + name[len(SCORE_PREFIX) :]
    return name


def current_umask() -> int:
    """The process umask, read from ``/proc`` where it can be (``os.umask`` can only read it by setting it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would have (0666 / 0777 less the umask): temporary
    directories and safetensors files start private."""
    base = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, base & ~current_umask())


def read_json(where: Path, error: type[Exception], missing: str) -> Any:
    """The JSON in file ``where``; no file (``missing`` says what it means) or invalid JSON is ``error``."""
    if not where.is_file():
        raise error(f"{where}: {missing}")
    try:
        return json.loads(where.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON ({e})") from None
