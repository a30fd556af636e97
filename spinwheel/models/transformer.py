"""A decoder-only transformer for the Llama family, Qwen2 and Qwen3.

References: LLaMA (Touvron et al., 2023) — RMSNorm pre-normalisation, SwiGLU MLP, rotary embeddings (Su et al.,
RoFormer); grouped-query attention (Ainslie et al., 2023); Llama-3 rope scaling; Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm). Parameter names follow Hugging Face's so checkpoints map one to one (see ``hf.py``).

The model knows nothing of parallelism or paging. Two seams let other subsystems work from outside:

* attention reads the number of heads from the projected tensors, not from the config, so tensor parallelism can
  swap ``q_proj``/``k_proj``/``v_proj``/``o_proj`` for column/row-split layers holding a subset of heads;
* the attention kernel is ``Attention.core`` (default :class:`SDPAAttention`); the engine replaces it with a paged
  kernel and passes its own metadata through ``forward(..., attn_metadata=...)``.

Shapes: B batch, T tokens, H query heads, G key/value heads, D head dim, C hidden size, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as HF does) and cast back before the gain.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) of the rotary embedding, with Llama-3 or linear scaling applied."""
    dim = config.head_dim
    assert dim is not None
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: keep high frequencies, divide low frequencies by `factor`, interpolate smoothly in between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (..., T) -> cos, sin (..., T, D), computed in fp32."""
        freqs = positions.float()[..., None] * self.inv_freq.float()  # (..., T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D); cos/sin (B, T, D)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


@dataclass
class AttentionMask:
    """Training-time attention metadata built once per forward by :class:`Transformer`.

    ``mask`` is a boolean (B, 1, T, T) tensor (True = may attend) or None for plain causal attention.
    ``segments``: padding-free packed sequences in one row (B = 1) — the boundaries ``0 = s₀ < s₁ < … = T``; each
    sequence attends causally within itself (one causal kernel per sequence, no (T, T) mask).
    """

    mask: torch.Tensor | None
    segments: tuple[int, ...] | None = None


class SDPAAttention(nn.Module):
    """Dense causal attention with PyTorch's scaled_dot_product_attention.

    q (B, T, H, D), k/v (B, T, G, D) -> (B, T, H, D). Key/value heads are repeated for grouped-query attention.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMask | None, layer_idx: int
    ) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|G, T, D)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask = meta.mask if meta is not None else None
        if meta is not None and meta.segments is not None:
            bounds = meta.segments
            parts = [
                F.scaled_dot_product_attention(q[..., s:e, :], k[..., s:e, :], v[..., s:e, :], is_causal=True)
                for s, e in zip(bounds[:-1], bounds[1:])
            ]
            out = torch.cat(parts, dim=2)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        assert self.head_dim is not None and config.num_key_value_heads is not None
        c, q_dim = config.hidden_size, config.num_attention_heads * self.head_dim
        kv_dim = config.num_key_value_heads * self.head_dim
        qkv_bias = config.attention_bias
        o_bias = config.attention_bias and config.model_type != "qwen2"  # qwen2: bias on q/k/v only
        self.q_proj = nn.Linear(c, q_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(c, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(c, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(q_dim, c, bias=o_bias)
        if config.qk_norm:
            self.q_norm: nn.Module | None = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm: nn.Module | None = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.core: nn.Module = SDPAAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: object) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts come from the projections, so a tensor-parallel shard with fewer heads works unchanged.
        q = self.q_proj(x).view(b, t, -1, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)  # (B, T, G, D)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)  # (B, T, G, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, attn_metadata, self.layer_idx)  # (B, T, H, D)
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(c, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(c, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, c, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: object) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_attention_mask(
    attention_mask: torch.Tensor | None, seq_ids: torch.Tensor | None, t: int, device: torch.device
) -> AttentionMask:
    """Combine causality with padding (``attention_mask`` (B, T), 1 = real token) and packing (``seq_ids`` (B, T):
    tokens attend only within the same packed sequence). Returns ``AttentionMask(None)`` for plain causal."""
    if attention_mask is None and seq_ids is None:
        return AttentionMask(None)
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    mask = causal[None, None]  # (1, 1, T, T)
    if seq_ids is not None:
        mask = mask & (seq_ids[:, None, :, None] == seq_ids[:, None, None, :])
    if attention_mask is not None:
        keep = attention_mask.bool()
        mask = mask & keep[:, None, None, :]
        # A padded query row would attend to nothing (NaN in softmax); let it see itself. Its output is ignored.
        eye = torch.eye(t, dtype=torch.bool, device=device)[None, None]
        mask = mask | (eye & ~keep[:, None, :, None])
    return AttentionMask(mask)


def run_blocks(
    blocks: Iterable[nn.Module],
    rotary: RotaryEmbedding,
    x: torch.Tensor,
    positions: torch.Tensor,
    attn_metadata: object,
) -> torch.Tensor:
    """The decoder stack: hidden states x (B, T, C) at ``positions`` (B, T) through ``blocks`` -> (B, T, C).

    :meth:`Transformer.forward` runs every block; a pipeline stage runs its own slice of them.
    """
    cos, sin = rotary(positions, x.dtype)  # (B, T, D)
    for block in blocks:
        x = block(x, cos, sin, attn_metadata)
    return x


class Transformer(nn.Module):
    """Decoder-only LM. Parameter names match HF's ``*ForCausalLM`` with the leading ``model.`` removed.

    With ``config.num_labels == 1`` the output layer ``lm_head`` is a (1, C) score head instead (a reward model or
    critic: HF's ``*ForSequenceClassification``, whose ``score.weight`` it holds; ``hf.py`` maps the name), and
    the forward returns per-token values (B, T, 1). Keeping one attribute name lets every parallel layout and
    pipeline stage treat both heads alike.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.num_outputs, bias=False)
        self.rotary = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, seed: int | None = None, std: float = 0.02) -> Transformer:
        """Random init (normal(0, std) for matrices and embeddings, ones for norms, zeros for biases)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).to(p.dtype))
        return self

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        seq_ids: torch.Tensor | None = None,
        attn_metadata: object = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, V), values (B, T, 1) for a scalar head, or final hidden states
        (B, T, C) with ``return_hidden``.

        * padded batches: ``attention_mask`` (B, T), 1 for real tokens (left or right padding); positions default
          to the count of real tokens before each one;
        * packed batches: ``positions`` (B, T) restart at 0 for each packed sequence and ``seq_ids`` (B, T) label
          which sequence a token belongs to;
        * external attention kernels (the engine) pass ``attn_metadata`` and explicit ``positions``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if positions is None:
            if attention_mask is not None:
                positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                positions = torch.arange(t, device=input_ids.device).expand(b, t)
        if attn_metadata is None:
            attn_metadata = build_attention_mask(attention_mask, seq_ids, t, input_ids.device)
        x = self.embed_tokens(input_ids)  # (B, T, C)
        x = run_blocks(self.layers, self.rotary, x, positions, attn_metadata)
        x = self.norm(x)
        if return_hidden:
            return x
        return self.lm_head(x)  # (B, T, V) or (B, T, 1)


def scalar_head_model(lm: Transformer, seed: int = 0, std: float | None = None) -> Transformer:
    """A reward model (or critic) initialised from the LM ``lm``: a copy of its body (embedding, blocks, final norm)
    under a fresh (1, C) score head drawn from normal(0, std), by default ``1 / sqrt(C + 1)`` as TRL's reward
    trainer does — small, so the initial scores are near zero. ``lm`` itself is left unchanged."""
    if (lazy := getattr(lm, "_lazy_checkpoint", None)) is not None:  # on the meta device (parallel.lazy_load)
        return lazy.scalar_head_model(lm, seed, std)
    config = dataclasses.replace(lm.config, num_labels=1, tie_word_embeddings=False, extra=dict(lm.config.extra))
    model = Transformer(config).to(device=lm.device, dtype=lm.dtype)
    body = {k: v for k, v in lm.state_dict().items() if not k.startswith("lm_head.")}
    missing, unexpected = model.load_state_dict(body, strict=False)
    assert not unexpected and [k for k in missing if not k.startswith("rotary.")] == ["lm_head.weight"], missing
    gen = torch.Generator().manual_seed(seed)
    std = std if std is not None else 1.0 / math.sqrt(config.hidden_size + 1)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen).mul_(std))
    return model


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``targets`` under ``logits``: logits (..., V), targets (...) -> (...), in fp32.

    For next-token log-probs of a sequence ``ids`` (B, T) use ``token_logprobs(logits[:, :-1], ids[:, 1:])``.
    """
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
