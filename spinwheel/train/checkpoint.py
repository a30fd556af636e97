"""Training checkpoints: a Hugging Face model directory (``config.json``, ``model.safetensors``, tokenizer) plus
``trainer_state.pt`` (step, optimizer state, RNG states), written atomically: everything goes to a temporary
directory beside the target, which then replaces the target by rename, so a crash never leaves a half-written
checkpoint behind. The temporary directory starts private (``mkdtemp``: 0700); before the rename its modes are set
from the umask like any directory the user creates, so colleagues on a shared filesystem can read the checkpoint.

A model carrying LoRA adapters is written as a PEFT adapter directory instead (``adapter_config.json`` +
``adapter_model.safetensors``, naming its base) beside the tokenizer and ``trainer_state.pt``: the frozen base is
not copied into every checkpoint. A scalar-head (reward) model with adapters is written merged, as HF's sequence
classifier that every reward-model consumer loads; its trainer state carries the adapters for an exact resume."""

from __future__ import annotations

import copy
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spinwheel.models.hf import apply_umask, save_pretrained
from spinwheel.models.lora import lora_layers, merge
from spinwheel.models.lora_io import save_adapter
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# torch.save's file writer reports a failed write (a full disk, a quota, a vanished mount) as a RuntimeError
# carrying one of these instead of an OSError.
TORCH_WRITE_FAILED = ("PytorchStreamWriter failed", "iostream error", "inline_container.cc")


def write_failure(exc: BaseException, ckpt_dir: Path) -> OSError | None:
    """A failed checkpoint write as a one-line :class:`OSError` naming the directory, the cause and the free space
    there (``exc``: torch.save's RuntimeError, or one raised while handling it); None for any other exception."""
    seen: BaseException | None = exc
    while seen is not None and not (isinstance(seen, RuntimeError) and any(s in str(seen) for s in TORCH_WRITE_FAILED)):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    where = next((p for p in (ckpt_dir, *ckpt_dir.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free / 2**20
    why = str(seen).strip().splitlines()[0][:160]
    return OSError(
        f"writing the checkpoint {ckpt_dir} failed ({why}); {free:.0f} MiB free on its disk: free space or choose "
        "another --out-dir, then rerun the same command (an earlier checkpoint there stays the latest)"
    )


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike,
    model: Transformer | None,
    tokenizer: Tokenizer | None,
    trainer_state: dict[str, Any] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint directory atomically; returns its path. ``extra(tmp)`` may add files to the temporary
    directory before it replaces the target (the parallel trainer's sharded state; with ``model`` None the model's
    files too: a parallel learner's streamed save)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        if model is None:
            pass  # ``extra`` writes them
        elif lora_layers(model) and model.config.num_labels is not None:  # a reward model: HF's files, merged
            save_pretrained(merge(copy.deepcopy(model)), tmp, tokenizer=tokenizer)
        elif lora_layers(model):
            save_adapter(model, tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        else:
            save_pretrained(model, tmp, tokenizer=tokenizer)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / STATE_FILE)
        if extra is not None:
            extra(tmp)
        for p in [tmp, *tmp.rglob("*")]:
            apply_umask(p)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        clear_leftovers(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def clear_leftovers(path: Path) -> None:
    """Remove what a process killed in the middle of an earlier save left beside the checkpoint ``path`` (its
    temporary directory, or the copy it was replacing); called once ``path`` holds a complete checkpoint again (a
    run's directory has one writer at a time: :mod:`~spinwheel.train.run_dir`'s lock)."""
    for leftover in [*path.parent.glob(f".{path.name}.tmp-*"), *path.parent.glob(f".{path.name}.old-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def recover_interrupted_save(path: Path) -> Path | None:
    """Put back the checkpoint a process killed between :func:`save_checkpoint`'s two renames left aside: with no
    ``path`` but a complete ``.{name}.old-*`` beside it (the previous checkpoint, moved out of the way), that copy
    becomes ``path`` again (the newest if several); returns it, or ``None`` when there was nothing to recover. Called
    by the run directory's one writer (its lock held) before a resume looks for ``path``."""
    if path.exists():
        return None
    olds = [p for p in path.parent.glob(f".{path.name}.old-*") if (p / STATE_FILE).is_file()]
    if not olds:
        return None
    newest = max(olds, key=lambda p: p.stat().st_mtime)
    os.replace(newest, path)
    return newest


def load_trainer_state(path: str | os.PathLike) -> dict[str, Any] | None:
    f = Path(path) / STATE_FILE
    if not f.is_file():
        return None
    return torch.load(f, map_location="cpu", weights_only=False)
