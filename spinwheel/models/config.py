"""Model configuration: one dataclass for the Llama / Qwen2 / Qwen3 decoder family, read from and written to
Hugging Face ``config.json`` dictionaries (both the ``rope_scaling`` + ``rope_theta`` form of transformers 4.x and
the ``rope_parameters`` form of transformers 5.x are understood).

A config with ``num_labels == 1`` describes a scalar-head model (a reward model or critic): the same decoder body
with a ``(1, hidden)`` score head instead of the LM head, written as HF's ``*ForSequenceClassification``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_CLS_ARCHITECTURES = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
}
_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class ConfigError(ValueError):
    """A model config that spinwheel cannot build; the message names the key and what was expected."""


# The config keys that fix the shapes of the weights.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer (Llama-family layout)."""

    vocab_size: int = 128
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # q/k/v (and, for llama, o) projection bias; qwen2 has q/k/v bias
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k before RoPE
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    num_labels: int | None = None  # None: LM head (V outputs); 1: scalar score head (reward model / critic)
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, written back unchanged

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        for key in (*SHAPE_FIELDS, "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config key '{key}' must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type '{self.model_type}': spinwheel supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"config key 'hidden_act' must be 'silu' (SwiGLU), got {self.hidden_act!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"config key 'rope_scaling.rope_type' must be one of {_SUPPORTED_ROPE_TYPES}, got {rope_type!r}"
                )
            if rope_type == "default":
                self.rope_scaling = None
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"config key 'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        if self.num_labels is not None:
            if self.num_labels != 1:
                raise ConfigError(
                    f"config key 'num_labels' must be 1 (a scalar reward / value head; spinwheel has "
                    f"no multi-class heads), got {self.num_labels!r}"
                )
            if self.tie_word_embeddings:
                raise ConfigError(
                    "a scalar-head model (num_labels 1) cannot tie its score head to the embeddings; "
                    "set tie_word_embeddings to false"
                )

    @property
    def num_outputs(self) -> int:
        """Width of the output layer: the vocabulary for an LM head, ``num_labels`` for a score head."""
        return self.num_labels if self.num_labels is not None else self.vocab_size

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, l = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim  # type: ignore
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        attn += h if self.attention_bias and self.model_type != "qwen2" else 0  # o_proj bias (not in qwen2)
        attn += 2 * self.head_dim if self.qk_norm else 0  # type: ignore[operator]
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        emb = self.vocab_size * h + (0 if self.tie_word_embeddings else self.num_outputs * h)
        return l * (attn + mlp + 2 * h) + h + emb

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json``; unsupported architectures raise :class:`ConfigError`."""
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type is None:
            raise ConfigError(f"config.json has no 'model_type' (expected one of {', '.join(SUPPORTED_MODEL_TYPES)})")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type '{model_type}' in config.json: spinwheel supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for key in required:
            if key not in d:
                raise ConfigError(f"config.json is missing required key '{key}'")
        rope_params = d.get("rope_parameters")
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        if isinstance(rope_params, dict):  # transformers >= 5
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(d.get("attention_bias", False))
        architectures = d.get("architectures") or []
        num_labels = None
        if any(str(a).endswith("ForSequenceClassification") for a in architectures):
            # transformers stores the label count as the id2label map (num_labels defaults to 2 without it).
            id2label = d.get("id2label")
            num_labels = len(id2label) if isinstance(id2label, dict) and id2label else d.get("num_labels", 2)
        known = {f.name for f in dataclasses.fields(cls)} | {"rope_parameters", "dtype", "architectures"}
        if num_labels is not None:
            known |= {"id2label", "label2id"}
        kwargs: dict[str, Any] = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads"),
            head_dim=d.get("head_dim"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            attention_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            # A sequence classifier has no LM head, so nothing is tied whatever the flag says.
            tie_word_embeddings=num_labels is None and bool(d.get("tie_word_embeddings", False)),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            hidden_act=d.get("hidden_act", "silu"),
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            num_labels=num_labels,
            extra={k: v for k, v in d.items() if k not in known},
        )
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dictionary that transformers (4.x and 5.x) loads."""
        d: dict[str, Any] = dict(self.extra)
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope_parameters.update(self.rope_scaling)
            rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
        scalar = self.num_labels is not None
        d.update(
            architectures=[(_CLS_ARCHITECTURES if scalar else _ARCHITECTURES)[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            rope_parameters=rope_parameters,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            torch_dtype=self.torch_dtype,
            dtype=self.torch_dtype,
        )
        if scalar:
            d.update(
                id2label={str(i): f"LABEL_{i}" for i in range(self.num_labels)},  # type: ignore[arg-type]
                label2id={f"LABEL_{i}": i for i in range(self.num_labels)},
            )  # type: ignore[arg-type]
        if self.model_type == "llama":
            d.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        if self.model_type == "qwen3":
            d.update(attention_bias=self.attention_bias)
        if self.model_type in ("qwen2", "qwen3"):
            d.setdefault("use_sliding_window", False)
            d.setdefault("layer_types", ["full_attention"] * self.num_hidden_layers)
        return d
