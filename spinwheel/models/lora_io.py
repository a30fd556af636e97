"""LoRA adapters on disk in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

What ``peft`` writes for a Llama-family model, and what :func:`save_adapter` writes too:

* ``adapter_config.json``: ``peft_type`` "LORA", ``task_type`` "CAUSAL_LM", ``r``, ``lora_alpha``, ``lora_dropout``,
  ``target_modules`` as HF module names (``q_proj`` ... ``down_proj``), ``bias`` "none", ``fan_in_fan_out`` false and
  ``base_model_name_or_path`` naming the base (a checkpoint directory, stored as an absolute path so that the adapter
  loads from anywhere; a Hub id or preset as it is);
* ``adapter_model.safetensors``: ``base_model.model.`` + the HF name of each factor, e.g.
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r).
  spinwheel adds the base's shape-defining config keys to the file's metadata (which ``peft`` ignores), so an
  adapter loaded onto another base fails on the config even where the shapes happen to agree.

:func:`load_adapter` reads such a directory (from spinwheel or from ``peft``) onto a model, :func:`read_adapter` only
reads its factors (the engine serves them without wrapping the model, :mod:`~spinwheel.engine.multi_lora`). Options
spinwheel does not implement (DoRA, biases, ``modules_to_save``, per-layer ranks, a subset of layers, ...) are
refused in one line, as is an adapter whose tensors or base config do not fit the model; the check runs before the
model is changed. ``--model ADAPTER_DIR`` loads the base :func:`adapter_base` names with the adapter folded in
(:func:`spinwheel.models.hf.load_model`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from spinwheel.models.config import SHAPE_FIELDS
from spinwheel.models.hf_format import apply_umask, hf_key, open_safetensors, our_name, read_json
from spinwheel.models.lora import TARGETS, LoRAConfig, LoRAError, apply_lora, lora_layers, lora_parameters
from spinwheel.models.transformer import Transformer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_BASE_META = "spinwheel.base_config"
# The config keys that fix the shapes an adapter is trained on (and the family it runs in).
BASE_FIELDS = ("model_type", *SHAPE_FIELDS)
# PEFT options that change what the adapter computes or holds; spinwheel implements none, so each must be off.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "rank_pattern": "per-layer ranks (rank_pattern)",
    "alpha_pattern": "per-layer alphas (alpha_pattern)",
    "layers_to_transform": "adapters on a subset of layers (layers_to_transform)",
    "layers_pattern": "layers_pattern",
    "layer_replication": "layer replication",
    "exclude_modules": "exclude_modules",
    "target_parameters": "adapters on nn.Parameters (target_parameters)",
    "trainable_token_indices": "trainable token embeddings",
    "fan_in_fan_out": "transposed (Conv1D) weights (fan_in_fan_out)",
    "use_qalora": "QALoRA",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "megatron_config": "Megatron layers (megatron_config)",
    "use_bdlora": "BD-LoRA",
    "velora_config": "VeLoRA",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing",
}


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding an ``adapter_config.json`` (a PEFT adapter, not a full model)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def save_adapter(model: Transformer, path: str | os.PathLike, base_model_name_or_path: str | None = None) -> None:
    """Write ``model``'s adapters to ``path`` in PEFT's format; ``base_model_name_or_path`` names the base (what
    ``--model`` was: a checkpoint directory, Hub id or preset), by default the adapters' config's."""
    layers = lora_layers(model)
    if not layers:
        raise LoRAError("the model has no LoRA adapters to save: apply_lora first, or save the full model")
    if model.config.num_labels is not None:
        raise LoRAError(
            "saving a scalar-head (reward / value) model's adapters in PEFT's format is not supported yet: "
            "merge the adapters and save the full model"
        )
    config = next(iter(layers.values())).config
    base_model_name_or_path = base_model_name_or_path or config.base_model_name_or_path
    if not base_model_name_or_path:
        raise LoRAError("name the adapters' base model (base_model_name_or_path) to save them: their files must say it")
    if Path(base_model_name_or_path).exists():  # a local path, stored absolute: the adapter loads from anywhere
        base_model_name_or_path = str(Path(base_model_name_or_path).resolve())
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_name_or_path),
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": [TARGETS[t].rpartition(".")[2] for t in config.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": config.use_rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")
    tensors = {PEFT_PREFIX + hf_key(n): p.detach().to("cpu").contiguous() for n, p in lora_parameters(model).items()}
    base = {k: getattr(model.config, k) for k in BASE_FIELDS}
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt", _BASE_META: json.dumps(base)})
    apply_umask(path / ADAPTER_WEIGHTS)


def _check_supported(raw: Any, where: Path) -> None:
    if not isinstance(raw, dict):
        raise LoRAError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type is {raw.get('peft_type')!r}; spinwheel loads LoRA adapters only")
    task = raw.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise LoRAError(f"{where}: task_type is {task!r}; spinwheel loads CAUSAL_LM adapters only")
    if raw.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias is {raw['bias']!r}; spinwheel supports bias 'none' only (biases stay frozen)")
    for key, what in _UNSUPPORTED.items():
        if raw.get(key):
            raise LoRAError(f"{where}: {key} is set ({what}), which spinwheel does not support: re-train without it")
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise LoRAError(
            f"{where}: target_modules is the regular expression {targets!r}; spinwheel reads a list of module names"
        )


def read_adapter_config(path: str | os.PathLike) -> LoRAConfig:
    """An adapter directory's :class:`LoRAConfig` (with the ``base_model_name_or_path`` it names); unsupported
    options raise :class:`LoRAError` naming the file and the option."""
    where = Path(path) / ADAPTER_CONFIG
    raw = read_json(where, LoRAError, f"no adapter_config.json: {path} is not a PEFT adapter directory")
    _check_supported(raw, where)
    try:
        config = LoRAConfig(
            rank=raw.get("r", 8),
            alpha=raw.get("lora_alpha", 8),
            dropout=raw.get("lora_dropout", 0.0),
            targets=raw.get("target_modules") or (),
            use_rslora=bool(raw.get("use_rslora", False)),
            base_model_name_or_path=raw.get("base_model_name_or_path"),
        )
    except LoRAError as e:
        raise LoRAError(f"{where}: {e}") from None
    return config


def _expected_shapes(model: Transformer, config: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """PEFT key -> shape of every factor ``config`` puts on ``model``."""
    out: dict[str, tuple[int, ...]] = {}
    for idx in range(len(model.layers)):
        for target in config.targets:
            name = f"layers.{idx}.{TARGETS[target]}"
            layer = model.get_submodule(name)
            out[PEFT_PREFIX + hf_key(name + ".lora_A.weight")] = (config.rank, layer.in_features)
            out[PEFT_PREFIX + hf_key(name + ".lora_B.weight")] = (layer.out_features, config.rank)
    return out


def _check_fits(model: Transformer, sf: Any, expected: dict[str, tuple[int, ...]], where: Path, base: str) -> None:
    hint = f"load the base it was trained on ({base})" if base else "load the base it was trained on"
    meta = (sf.metadata() or {}).get(_BASE_META)
    if meta:
        for key, value in json.loads(meta).items():
            if key in BASE_FIELDS and getattr(model.config, key) != value:
                raise LoRAError(
                    f"{where}: the adapter's base has {key} {value}, the model {getattr(model.config, key)}: {hint}"
                )
    keys = set(sf.keys())
    extra = sorted(keys - set(expected))
    if extra:
        raise LoRAError(f"{where}: tensor '{extra[0]}' has no place in the model (its base differs): {hint}")
    missing = sorted(set(expected) - keys, key=list(expected).index)
    if missing:
        raise LoRAError(f"{where}: no tensor '{missing[0]}' for the model's layer (its base differs): {hint}")
    for key, shape in expected.items():
        got = tuple(sf.get_slice(key).get_shape())
        if got != shape:
            raise LoRAError(
                f"{where}: tensor '{key}' has shape {got}, the model needs {shape} (its base differs): {hint}"
            )


def read_adapter(model: Transformer, path: str | os.PathLike) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """The adapter saved in ``path`` (spinwheel's or ``peft``'s) for ``model``: its config and its factors under
    spinwheel's names (``layers.0.self_attn.q_proj.lora_A.weight``), nothing changed on the model.

    Every tensor name and shape (and, for spinwheel's files, the base config) is checked against the model first; a
    mismatch is a :class:`LoRAError` naming the tensor or key and the base to load instead."""
    config = read_adapter_config(path)
    where = Path(path) / ADAPTER_WEIGHTS
    if not where.is_file():
        other = (
            " (adapter_model.bin is not read: re-save with safetensors)"
            if (Path(path) / "adapter_model.bin").is_file()
            else ""
        )
        raise LoRAError(f"{where}: no adapter_model.safetensors in the adapter directory{other}")
    expected = _expected_shapes(model, config)
    with open_safetensors(str(where)) as sf:
        _check_fits(model, sf, expected, where, config.base_model_name_or_path or "")
        tensors = {our_name(key[len(PEFT_PREFIX) :]): sf.get_tensor(key) for key in expected}
    for key, tensor in zip(expected, tensors.values()):
        if not torch.isfinite(tensor).all():
            raise LoRAError(f"{where}: tensor '{key}' holds non-finite values (NaN or inf): the adapter is broken")
    return config, tensors


def load_adapter(model: Transformer, path: str | os.PathLike) -> LoRAConfig:
    """Put the adapter saved in ``path`` (spinwheel's or ``peft``'s) on ``model``, in place, and return its config;
    checked as :func:`read_adapter` checks it, before anything changes."""
    if lora_layers(model):
        raise LoRAError("the model already has LoRA adapters: load the adapter onto the plain base model")
    config, tensors = read_adapter(model, path)
    apply_lora(model, config, seed=0)  # a seeded draw leaves the global RNG (a resumed run's) untouched
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            p.copy_(tensors[name])
    return config


def adapter_base(path: str | os.PathLike) -> str:
    """The base an adapter directory names (``base_model_name_or_path``): a path as given (relative to the working
    directory), else beside the adapter when it is a directory there; a preset or Hub id as it is."""
    base = read_adapter_config(path).base_model_name_or_path
    if not base:
        raise LoRAError(f"{Path(path) / ADAPTER_CONFIG}: base_model_name_or_path is empty: pass the base model too")
    beside = Path(path) / base
    return str(beside) if not Path(base).exists() and beside.is_dir() else base
