"""GGUF files (llama.cpp's format) read into a plain Hugging Face checkpoint directory.

The file is read with the ``gguf`` package (llama.cpp's own reader; extra ``spinwheel[smollm2]`` or ``pip install
gguf``) and every tensor dequantized to float32 with its ``dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K
quants, ...). What transformers' GGUF loader does, written as our own conversion:

- names: ``blk.N.attn_q.weight`` → ``model.layers.N.self_attn.q_proj.weight`` and so on (:data:`_LAYER_NAMES`);
- llama.cpp's converter permutes the rows of Llama's q/k projections (rotary halves interleaved); the inverse
  permutation restores HF's order (:func:`_unpermute`); Qwen files are stored unpermuted;
- ``config.json`` from the ``{arch}.*`` metadata, tied embeddings when the file has no ``output.weight``;
- the tokenizer from ``tokenizer.ggml.*``: byte-level BPE (``gpt2``) over the stored tokens and merges, control and
  user-defined tokens as added tokens, the pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre``, and the chat
  template from ``tokenizer.chat_template``.

The result holds the files spinwheel writes for any checkpoint, so a converted directory is what ``transformers`` and
spinwheel's own loaders read. ``spinwheel convert`` writes one;
:mod:`~spinwheel.models.gguf_cache` converts once into a cache wherever a ``.gguf`` is given as ``--model``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spinwheel.models.hf_format import CheckpointError, apply_umask, our_name

SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# tokenizer.ggml.token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's pre-tokenizer regexes for the byte-level BPE vocabularies (llama-vocab.cpp), by tokenizer.ggml.pre
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class GGUFError(CheckpointError):
    """A GGUF file spinwheel cannot convert; the message names the file and what is wrong."""


def _reader(path: Path) -> Any:
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            f"{path}: reading GGUF files needs the gguf package: pip install 'spinwheel[smollm2]' (or pip install gguf)"
        ) from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file: numpy/ValueError from deep inside the reader
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: rows ``(head, 2, half)`` were stored as ``(head, half, 2)``."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_KEY.match(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"tensor '{name}' has no Hugging Face counterpart spinwheel knows")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _dequantized(t: Any) -> torch.Tensor:
    """One tensor as float32 in PyTorch's (row-major) shape: GGUF lists dimensions fastest first."""
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape))
    try:
        array = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"tensor '{t.name}' is stored as {t.tensor_type.name}, which gguf cannot dequantize") from None
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C").reshape(shape))  # a writable copy


def hf_config(reader: Any, path: Path, tensor_names: set[str]) -> dict[str, Any]:
    """``config.json`` for the file's architecture, from its ``{arch}.*`` and ``tokenizer.ggml.*`` metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(
            f"{path}: architecture '{arch}' is not supported (spinwheel reads {', '.join(SUPPORTED_ARCHS)})"
        )
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"{path}: llama3-style rope scaling (rope_freqs.weight) is not read from GGUF yet")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    cfg = {
        "architectures": [SUPPORTED_ARCHS[arch]],
        "model_type": arch,
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    return cfg


def gguf_state_dict(reader: Any, path: Path, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor under its HF name, float32, Llama's q/k rows back in HF order."""
    state: dict[str, torch.Tensor] = {}
    permute = config["model_type"] == "llama"
    for t in reader.tensors:
        try:
            name = _hf_name(t.name)
        except GGUFError as e:
            raise GGUFError(f"{path}: {e}") from None
        w = _dequantized(t)
        if permute and ".self_attn.q_proj." in name:
            w = _unpermute(w, config["num_attention_heads"])
        elif permute and ".self_attn.k_proj." in name:
            w = _unpermute(w, config["num_key_value_heads"])
        state[name] = w
    return state


def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp: every digit alone, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


def gguf_tokenizer_files(reader: Any, path: Path) -> tuple[Any, dict[str, Any]]:
    """The ``tokenizers`` backend and the ``tokenizer_config.json`` content the file's metadata describes."""
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer model '{kind}' is not read yet (spinwheel reads byte-level BPE, 'gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_CONTROL, _USER_DEFINED)
    ]
    backend.add_tokens(added)

    def token(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("bos")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokens.index(bos))]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    cfg = {
        "bos_token": bos,
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return backend, {k: v for k, v in cfg.items() if v is not None}


def _check_shapes(src: Path, raw: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Every tensor the config describes is in the file with its shape (on the meta device: nothing allocated)."""
    from spinwheel.models.config import ConfigError, ModelConfig
    from spinwheel.models.transformer import Transformer

    try:
        config = ModelConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise GGUFError(f"{src}: {e}") from None
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items() if k != "rotary.inv_freq"}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    got = {our_name(k): tuple(v.shape) for k, v in state.items()}
    for name, shape in expected.items():
        if got.get(name) != shape:
            what = "is missing" if name not in got else f"has shape {got[name]}"
            raise GGUFError(f"{src}: tensor for '{name}' {what}, expected {shape} from the file's metadata")


def convert_gguf(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write ``src`` (a ``.gguf`` file) as a plain HF checkpoint directory ``out`` (float32 ``model.safetensors``,
    ``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``), the files
    :func:`~spinwheel.models.hf.save_pretrained` writes. Written from the file's own pieces, below the loaders
    (which resolve ``--model`` through this module)."""
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    reader = _reader(src)
    raw = hf_config(reader, src, {t.name for t in reader.tensors})
    backend, tok_cfg = gguf_tokenizer_files(reader, src)
    state = gguf_state_dict(reader, src, raw)
    _check_shapes(src, raw, state)
    ids = {
        f"{k}_token_id": backend.token_to_id(tok_cfg[f"{k}_token"])
        for k in ("bos", "eos", "pad")
        if k + "_token" in tok_cfg
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    apply_umask(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**raw, **ids}, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
    backend.save(str(out / "tokenizer.json"))
    tok_cfg |= {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out
