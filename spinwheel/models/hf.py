"""Hugging Face checkpoint I/O: ``config.json`` + ``model.safetensors`` (or sharded ``model-0000i-of-0000n``
``.safetensors`` with ``model.safetensors.index.json``), loaded into and saved from :class:`Transformer`.

A scalar-head model (``num_labels == 1``, a reward model) is written as HF's ``*ForSequenceClassification``: its
output layer ``lm_head`` is stored as ``score.weight`` and read back from it.

Saved with its tokenizer, a checkpoint carries the special-token ids (``bos_token_id``, ``eos_token_id``,
``pad_token_id``) in ``config.json`` and a ``generation_config.json``, so ``transformers``' ``generate`` stops at
EOS as spinwheel's engine does. Files are written with the modes the umask gives (safetensors writes 0600).

Loading asserts every key and shape (as nanoGPT's ``from_pretrained`` does) against the safetensors headers before
any tensor is read or the model allocated: a missing, unexpected or mis-shaped tensor, or a ``config.json`` that
describes more (or fewer) layers than the checkpoint holds, raises :class:`CheckpointError` naming the key and
what was expected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from spinwheel.models.config import ConfigError, ModelConfig
from spinwheel.models.transformer import Transformer, rope_inv_freq

if TYPE_CHECKING:
    from spinwheel.models.tokenizer import Tokenizer

_HF_PREFIX = "model."
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or key and what was expected."""


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype '{dtype}': use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


_SCORE = "score."  # the output layer of HF's *ForSequenceClassification


def hf_key(name: str, scalar_head: bool = False) -> str:
    """spinwheel parameter name -> HF name (``layers.0.mlp.up_proj.weight`` -> ``model.layers.0...``; the output
    layer is ``lm_head.weight``, or ``score.weight`` for a scalar head)."""
    if name.startswith("lm_head."):
        return _SCORE + name[len("lm_head.") :] if scalar_head else name
    return _HF_PREFIX + name


def load_config(path: str | os.PathLike) -> ModelConfig:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: no config.json in the checkpoint directory")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
    try:
        return ModelConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: expected a 'weight_map' object")
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(
            f"{path}: no model.safetensors (or sharded *.safetensors with "
            "model.safetensors.index.json) in the checkpoint directory"
        )
    return found


def _our_name(key: str) -> str:
    """HF tensor name -> spinwheel's (inverse of :func:`hf_key`)."""
    name = key[len(_HF_PREFIX) :] if key.startswith(_HF_PREFIX) else key
    if name.startswith(_SCORE):  # a sequence classifier's head is our output layer
        name = "lm_head." + name[len(_SCORE) :]
    return name


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, under spinwheel's names."""
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                out[_our_name(key)] = sf.get_tensor(key)
    return out


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape under spinwheel's names, from the safetensors headers alone: no tensor is read."""
    out: dict[str, tuple[int, ...]] = {}
    for f in _weight_files(Path(path)):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                out[_our_name(key)] = tuple(sf.get_slice(key).get_shape())
    return out


def check_config(path: str | os.PathLike, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> Transformer:
    """The model ``config`` describes, on the meta device; :class:`CheckpointError` unless it has exactly the
    tensors in ``shapes`` (names and shapes). Nothing is allocated, and a doctored ``config.json`` fails in a line:
    layers the checkpoint lacks are counted from the tensor names first (``num_hidden_layers`` 10^6 over a 2-layer
    checkpoint would otherwise build a million modules, even on the meta device); then the meta model's state is
    compared with the header."""
    layers = {int(name.split(".")[1]) for name in shapes if name.startswith("layers.") and name.split(".")[1].isdigit()}
    if config.num_hidden_layers > len(layers):
        raise CheckpointError(
            f"{Path(path) / 'config.json'}: num_hidden_layers is {config.num_hidden_layers}, but the checkpoint's "
            f"tensors hold {len(layers)} layers"
        )
    with torch.device("meta"):
        model = Transformer(config)
    expected = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    shapes = dict(shapes)
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        shapes.pop("lm_head.weight", None)  # some tied checkpoints still carry the head; it equals the embedding
    scalar = config.num_labels is not None
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise CheckpointError(
            f"{path}: missing tensor '{hf_key(missing[0], scalar)}'"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    unexpected = [k for k in shapes if k not in expected and not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected tensor '{hf_key(unexpected[0], scalar)}' for a "
            f"{config.model_type} model with this config.json"
        )
    for name, ref in expected.items():
        if shapes[name] != ref:
            raise CheckpointError(
                f"{path}: tensor '{hf_key(name, scalar)}' has shape {shapes[name]}, expected {ref} from config.json"
            )
    return model


def load_model(
    path_or_preset: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> Transformer:
    """Load a checkpoint directory or a Hugging Face Hub id (through the local HF cache, see
    :mod:`~spinwheel.models.hub`), or build a built-in preset (``tiny``, ``small``, ``test``) with random weights.

    ``dtype`` defaults to the checkpoint's ``torch_dtype``; presets use ``vocab_size`` (default: the built-in char
    tokenizer's) and ``seed``.
    """
    from spinwheel.models.hub import resolve_model_path
    from spinwheel.models.presets import PRESETS, preset_config

    path_or_preset = resolve_model_path(path_or_preset)
    path = Path(path_or_preset)
    if str(path_or_preset) in PRESETS and not path.exists():
        if vocab_size is None:
            from spinwheel.models.tokenizer import Tokenizer

            vocab_size = Tokenizer.char_level().vocab_size
        model = Transformer(preset_config(str(path_or_preset), vocab_size)).init_weights(seed)
        return model.to(device=device, dtype=resolve_dtype(dtype) or torch.float32)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found (or use a preset: {', '.join(PRESETS)})")
    config = load_config(path)
    model = check_config(path, config, tensor_shapes(path))  # before any tensor is read or memory allocated
    state = load_state_dict(path)
    target = resolve_dtype(dtype) or _DTYPES.get(config.torch_dtype, torch.float32)
    expected = [n for n in model.state_dict() if not (config.tie_word_embeddings and n == "lm_head.weight")]
    model = model.to_empty(device=device or "cpu")
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=False)
    # to_empty left the non-persistent RoPE buffer uninitialised; it is not in the file, so recompute it.
    model.rotary.inv_freq = rope_inv_freq(config).to(model.device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=target)


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


def special_token_ids(config: ModelConfig, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for ``config.json``: the config's own where set, else
    the tokenizer's; EOS is every id either names (a chat model may end turns with a token other than its
    config's EOS)."""
    eos = (
        config.eos_token_id
        if isinstance(config.eos_token_id, list)
        else ([] if config.eos_token_id is None else [config.eos_token_id])
    )
    if tokenizer is not None and tokenizer.eos_id is not None and tokenizer.eos_id not in eos:
        eos = [tokenizer.eos_id, *eos]
    tok = {"bos_token_id": tokenizer.bos_id, "pad_token_id": tokenizer.pad_id} if tokenizer is not None else {}
    return {
        "bos_token_id": config.bos_token_id if config.bos_token_id is not None else tok.get("bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.pad_token_id if config.pad_token_id is not None else tok.get("pad_token_id"),
    }


def save_pretrained(
    model: Transformer, path: str | os.PathLike, shard_size_bytes: int | None = None, tokenizer: Tokenizer | None = None
) -> None:
    """Write ``config.json``, ``generation_config.json`` and safetensors (sharded when ``shard_size_bytes`` is set
    and exceeded), and ``tokenizer``'s files when given (its special-token ids then go into both configs)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    config.torch_dtype = str(model.dtype).removeprefix("torch.")
    ids = special_token_ids(config, tokenizer)
    (path / "config.json").write_text(json.dumps({**config.to_hf_dict(), **ids}, indent=2, sort_keys=True) + "\n")
    if config.num_labels is None and any(v is not None for v in ids.values()):  # a scalar head generates nothing
        generation = {k: v for k, v in ids.items() if v is not None}
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.startswith("rotary."):
            continue
        tensors[hf_key(name, config.num_labels is not None)] = t.detach().to("cpu").contiguous()
    metadata = {"format": "pt"}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if shard_size_bytes is None or total <= shard_size_bytes:
        save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
        apply_umask(path / "model.safetensors")
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_size_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata=metadata)
        apply_umask(path / name)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
