"""Hugging Face Hub ids where a checkpoint directory is expected (``--model Qwen/Qwen2.5-0.5B``).

An id is looked up in the local Hugging Face cache first (``$HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``, where ``hf download`` and ``transformers`` put models) without touching the network;
only a model that is not there is downloaded into that cache, and only what spinwheel reads (``*.json``,
``*.safetensors``, a chat template). Without network (or with ``HF_HUB_OFFLINE=1``) a model that is not cached is a
one-line error saying how to get it. Existing paths and built-in presets are never looked up.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from spinwheel.models.presets import PRESETS

HUB_FILES = ["*.json", "*.safetensors", "*.jinja"]
# owner/name, as the Hub spells repository ids (a path with more parts is a local path, never an id)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubModelError(ValueError):
    """A Hub id that is neither in the local cache nor downloadable; the message says what to do."""


def is_hub_id(name: str | os.PathLike) -> bool:
    """Whether ``name`` reads as a Hub id: ``owner/name``, not an existing path and not a preset."""
    s = str(name)
    return s not in PRESETS and not Path(s).exists() and _REPO_ID.match(s) is not None


def _complete(snapshot: Path) -> bool:
    return (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors"))


def _reason(e: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(e, GatedRepoError):
        return "the model is gated: accept its terms on huggingface.co and log in with `hf auth login`"
    if isinstance(e, RepositoryNotFoundError):
        return "no such model on the Hub (or it is private: log in with `hf auth login`)"
    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE)"
    cause = e.__cause__ or e
    first = (str(cause).strip().splitlines() or [""])[0]
    text = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    return (
        "the Hub is unreachable (" + (text if len(text) <= 120 else text[:117] + "...") + ")"
        if "Connect" in type(cause).__name__ or "Timeout" in type(cause).__name__
        else text
    )


def resolve_model_path(name: str | os.PathLike) -> str | os.PathLike:
    """``name`` itself, unless it is a GGUF file, a directory holding one or a named model (the HF checkpoint
    converted from it, :mod:`~spinwheel.models.gguf_cache`), or a Hub id (:func:`is_hub_id`): then the directory of
    its snapshot in the local cache, downloaded first if it is not cached."""
    from spinwheel.models.gguf_cache import cached_checkpoint, gguf_source

    if (gguf := gguf_source(name)) is not None:
        return cached_checkpoint(gguf)
    if not is_hub_id(name):
        return name
    from huggingface_hub import constants, snapshot_download

    repo_id = str(name)
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True))
        if _complete(cached):
            return cached
    except Exception:  # not cached (huggingface_hub's LocalEntryNotFoundError and kin): try the network
        pass
    try:
        downloaded = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:
        raise HubModelError(
            f"{repo_id}: not a checkpoint directory or a preset ({', '.join(PRESETS)}), and not in the local "
            f"Hugging Face cache ({constants.HF_HUB_CACHE}); downloading it failed: {_reason(e)}. Download it where "
            f"there is network (`hf download {repo_id}`), or pass a local directory"
        ) from None
    if not _complete(downloaded):
        raise HubModelError(
            f"{repo_id}: the Hub model has no config.json and *.safetensors weights (spinwheel reads safetensors only)"
        )
    return downloaded
