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
from safetensors.torch import save_file

from spinwheel.models.config import ConfigError, ModelConfig
from spinwheel.models.hf_format import CheckpointError, apply_umask, hf_key, open_safetensors, our_name, read_json
from spinwheel.models.lora import LoRAError, merge
from spinwheel.models.lora_io import ADAPTER_CONFIG, adapter_base, is_adapter_dir, load_adapter
from spinwheel.models.transformer import Transformer, rope_inv_freq

if TYPE_CHECKING:
    from spinwheel.models.tokenizer import Tokenizer

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype '{dtype}': use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_config(path: str | os.PathLike) -> ModelConfig:
    cfg_path = Path(path) / "config.json"
    raw = read_json(cfg_path, CheckpointError, "no config.json in the checkpoint directory")
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


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, under spinwheel's names."""
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        with open_safetensors(str(f)) as sf:
            for key in sf.keys():
                out[our_name(key)] = sf.get_tensor(key)
    return out


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape under spinwheel's names, from the safetensors headers alone: no tensor is read."""
    out: dict[str, tuple[int, ...]] = {}
    for f in _weight_files(Path(path)):
        with open_safetensors(str(f)) as sf:
            for key in sf.keys():
                out[our_name(key)] = tuple(sf.get_slice(key).get_shape())
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
    merge_adapter: bool = True,
    lazy: bool = False,
) -> Transformer:
    """Load a checkpoint directory or a Hugging Face Hub id (through the local HF cache, see
    :mod:`~spinwheel.models.hub`), or build a built-in preset (``tiny``, ``small``, ``test``) with random weights.

    A PEFT adapter directory (``adapter_config.json``) loads the base it names with the adapter folded in: the model
    the adapter run produced (see :func:`load_adapted`; ``merge_adapter=False`` keeps it as LoRA layers).
    ``dtype`` defaults to the checkpoint's ``torch_dtype``; presets use ``vocab_size`` (default: the built-in char
    tokenizer's) and ``seed``. ``lazy`` (a learner's model under torchrun): a checkpoint directory comes back on the
    meta device, read piece by piece as ``parallelize`` shards it (:mod:`spinwheel.parallel.io.lazy_load`); presets
    and adapter directories load whole.
    """
    from spinwheel.models.hub import resolve_model_path
    from spinwheel.models.presets import PRESETS, preset_config

    path_or_preset = resolve_model_path(path_or_preset)
    path = Path(path_or_preset)
    if is_adapter_dir(path):
        return load_adapted(path, merge_adapter, dtype=dtype, device=device, seed=seed, vocab_size=vocab_size)
    if str(path_or_preset) in PRESETS and not path.exists():
        if vocab_size is None:
            from spinwheel.models.tokenizer import Tokenizer

            vocab_size = Tokenizer.char_level().vocab_size
        model = Transformer(preset_config(str(path_or_preset), vocab_size)).init_weights(seed)
        return model.to(device=device, dtype=resolve_dtype(dtype) or torch.float32)
    if not path.is_dir():
        what = "is a file, not a checkpoint directory" if path.is_file() else "checkpoint directory not found"
        raise CheckpointError(f"{path}: {what} (or use a preset: {', '.join(PRESETS)})")
    config = load_config(path)
    model = check_config(path, config, tensor_shapes(path))  # before any tensor is read or memory allocated
    target = resolve_dtype(dtype) or _DTYPES.get(config.torch_dtype, torch.float32)
    if lazy:
        from spinwheel.parallel.io.lazy_load import lazy_model

        return lazy_model(path, _weight_files(path), config, target, device)
    state = load_state_dict(path)
    expected = [n for n in model.state_dict() if not (config.tie_word_embeddings and n == "lm_head.weight")]
    model = model.to_empty(device=device or "cpu")
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=False)
    # to_empty left the non-persistent RoPE buffer uninitialised; it is not in the file, so recompute it.
    model.rotary.inv_freq = rope_inv_freq(config).to(model.device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=target)


def load_adapted(path: str | os.PathLike, merge_adapter: bool = True, **load: Any) -> Transformer:
    """The base a PEFT adapter directory names (``base_model_name_or_path``, see
    :func:`~spinwheel.models.lora_io.adapter_base`) with the adapter on it: folded into the weights (``merge_adapter``)
    or as LoRA layers on the frozen base. A base that is itself an adapter directory (a LoRA run started from an
    adapter) is loaded merged first, down the chain. ``load`` goes to :func:`load_model` for the plain base; a base
    that cannot be loaded is a one-line :class:`CheckpointError` naming the adapter and the base."""
    from spinwheel.models.hub import HubModelError

    chain = [Path(path)]
    base = adapter_base(path)
    while is_adapter_dir(base):
        if any(Path(base).resolve() == p.resolve() for p in chain):
            raise LoRAError(f"{chain[-1] / ADAPTER_CONFIG}: its base_model_name_or_path '{base}' leads back to itself")
        chain.append(Path(base))
        base = adapter_base(base)
    try:
        model = load_model(base, **load)
    except (CheckpointError, HubModelError) as e:
        raise CheckpointError(
            f"{chain[-1] / ADAPTER_CONFIG}: its base model '{base}' (base_model_name_or_path) cannot be loaded: {e}"
        ) from None
    for i, adapter in enumerate(reversed(chain)):
        load_adapter(model, adapter)
        if merge_adapter or i < len(chain) - 1:
            merge(model)
    return model


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


SAFETENSORS_METADATA = {"format": "pt"}


def hf_tensor_name(name: str, config: ModelConfig) -> str | None:
    """The name ``model.safetensors`` stores the state-dict entry ``name`` under (:func:`hf_key`); None for what
    it leaves out: the RoPE buffer (computed) and a tied head (it is the embedding)."""
    if name.startswith("rotary.") or (config.tie_word_embeddings and name == "lm_head.weight"):
        return None
    return hf_key(name, config.num_labels is not None)


def save_config(config: ModelConfig, path: str | os.PathLike, tokenizer: Tokenizer | None = None) -> None:
    """Write ``config.json`` and ``generation_config.json`` (with the special-token ids) and ``tokenizer``'s files:
    a checkpoint directory without its tensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = special_token_ids(config, tokenizer)
    (path / "config.json").write_text(json.dumps({**config.to_hf_dict(), **ids}, indent=2, sort_keys=True) + "\n")
    if config.num_labels is None and any(v is not None for v in ids.values()):  # a scalar head generates nothing
        generation = {k: v for k, v in ids.items() if v is not None}
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def save_pretrained(
    model: Transformer, path: str | os.PathLike, shard_size_bytes: int | None = None, tokenizer: Tokenizer | None = None
) -> None:
    """Write ``config.json``, ``generation_config.json`` and safetensors (sharded when ``shard_size_bytes`` is set
    and exceeded), and ``tokenizer``'s files when given (its special-token ids then go into both configs)."""
    path = Path(path)
    config = model.config
    config.torch_dtype = str(model.dtype).removeprefix("torch.")
    save_config(config, path, tokenizer)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if (key := hf_tensor_name(name, config)) is not None:
            tensors[key] = t.detach().to("cpu").contiguous()
    metadata = SAFETENSORS_METADATA
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
