"""Training clients' state on disk, under the service's run directory, named by ``tinker://`` paths.

    tinker://MODEL_ID/weights/NAME          ->  RUN_DIR/MODEL_ID/weights/NAME/          (save_state)
    tinker://MODEL_ID/sampler_weights/NAME  ->  RUN_DIR/MODEL_ID/sampler_weights/NAME/  (save_weights_for_sampler)

Each holds the adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``, the layout of
:mod:`spinwheel.models.lora_io`, so ``peft``, ``spinwheel merge`` and ``spinwheel serve --lora`` read it);
``save_state`` adds ``optimizer.pt`` (the AdamW state of the adapter parameters, in their order, and the step count).
A directory is written under a temporary name and renamed into place, so a path that exists is whole. Nothing but
the run directory is read: a path that names anything outside it is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from spinwheel.models.hf_format import hf_key
from spinwheel.models.lora import TARGETS, LoRAConfig
from spinwheel.models.lora_io import _BASE_META, ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FIELDS, PEFT_PREFIX, read_adapter
from spinwheel.models.transformer import Transformer
from spinwheel.tinker.adapters import ClientAdapter

KINDS = ("weights", "sampler_weights")
OPTIMIZER_FILE = "optimizer.pt"


class CheckpointPathError(ValueError):
    """A tinker:// path that is malformed, outside the run directory, or names no saved state."""


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def _safe(part: str, what: str) -> str:
    if not part or part in (".", "..") or "/" in part or "\\" in part or "\0" in part:
        raise CheckpointPathError(f"{what} '{part}' is not a plain name: use letters, digits, '-', '_', '.', ':'")
    return part


def local_dir(run_dir: Path, path: str) -> tuple[Path, str, str]:
    """``tinker://MODEL_ID/KIND/NAME`` -> (its directory under ``run_dir``, MODEL_ID, KIND)."""
    if not path.startswith("tinker://"):
        raise CheckpointPathError(f"'{path}' is not a tinker:// path (tinker://MODEL_ID/weights/NAME)")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise CheckpointPathError(f"'{path}': expected tinker://MODEL_ID/weights/NAME or .../sampler_weights/NAME")
    model_id, kind, name = _safe(parts[0], "model id"), parts[1], _safe(parts[2], "checkpoint name")
    return run_dir / model_id / kind / name, model_id, kind


def _write_adapter(client: ClientAdapter, model: Transformer, base_name: str, path: Path) -> None:
    config = client.config
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "target_modules": [TARGETS[t].rpartition(".")[2] for t in config.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft, indent=2, sort_keys=True) + "\n")
    tensors = {PEFT_PREFIX + hf_key(n): p.detach().to("cpu").contiguous() for n, p in client.params.items()}
    base = {k: getattr(model.config, k) for k in BASE_FIELDS}
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt", _BASE_META: json.dumps(base)})


def save(
    run_dir: Path, client: ClientAdapter, model: Transformer, base_name: str, kind: str, name: str, optimizer: bool
) -> str:
    """Write ``client``'s adapter (and with ``optimizer`` its AdamW state) as ``tinker://MODEL_ID/KIND/NAME``;
    an existing checkpoint of that name is replaced whole. Returns the tinker:// path."""
    path = tinker_path(client.client, kind, _safe(name, "checkpoint name"))
    target, _, _ = local_dir(run_dir, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        _write_adapter(client, model, base_name, tmp)
        if optimizer:
            state = {"optimizer": client.optimizer.state_dict(), "num_steps": client.num_steps}
            torch.save(state, tmp / OPTIMIZER_FILE)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read(run_dir: Path, model: Transformer, path: str) -> tuple[LoRAConfig, dict[str, torch.Tensor], dict | None]:
    """The adapter config, factors (spinwheel names) and optimizer state (None if not saved) at ``path``."""
    local, _, _ = local_dir(run_dir, path)
    if not (local / ADAPTER_CONFIG).is_file():
        raise CheckpointPathError(f"'{path}': no saved state there (looked in {local})")
    config, tensors = read_adapter(model, local)
    opt = local / OPTIMIZER_FILE
    state = torch.load(opt, map_location="cpu", weights_only=True) if opt.is_file() else None
    return config, tensors, state


def restore(client: ClientAdapter, tensors: dict[str, torch.Tensor], state: dict | None, path: str) -> None:
    """Put saved factors (and, when ``state`` is given, the AdamW state and step count) on ``client``."""
    client.load_factors(tensors)
    client.reset_optimizer()
    if state is not None:
        client.optimizer.load_state_dict(state["optimizer"])
        client.num_steps = int(state["num_steps"])


def list_checkpoints(run_dir: Path, model_id: str) -> list[str]:
    root = run_dir / _safe(model_id, "model id")
    return [
        tinker_path(model_id, kind, d.name)
        for kind in KINDS
        if (root / kind).is_dir()
        for d in sorted((root / kind).iterdir())
        if (d / ADAPTER_CONFIG).is_file()
    ]
