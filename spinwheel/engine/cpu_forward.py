"""The engine's CPU forward for decode-sized steps: every projection as ``W @ X^T``, activations kept feature-major.

``nn.Linear`` computes ``X @ W^T``. In BLAS terms the weight is then the transposed right-hand operand, and for the
few-token GEMMs of a decode step (M = the batch, tens of rows, against weights that stream from DRAM every step)
MKL's sgemm spends a large share of its time packing that operand. Computing the transposed product
``W @ X^T`` instead makes the weight the untransposed left operand. Measured on this project's benchmark machine
(2 threads, cold weights, the 28M-parameter benchmark model's shapes): 25-35% less time for M = 32-256 rows
(e.g. the 8192 x 512 LM head at M = 64: 3.8 ms against 5.8 ms), equal at M ~ 1024 and slightly slower beyond, so the
runner uses this path only up to :data:`MAX_TOKENS` tokens per step and the model's own forward above.

The activations therefore live as ``X^T`` (C, N): the output of one projection is directly the right operand of
the next, residual adds fold into ``addmm_``, and RMSNorm reduces over dim 0. Only attention sees the usual
(N, heads, D) layout. The math is the model's own (:mod:`spinwheel.models.transformer`: RMSNorm in fp32 with the
gain applied last, rotate-half RoPE, SwiGLU, optional q/k norms and biases), read from the same parameters, so a
weight update reaches it at once; tests check it against the model's forward and HF ``generate``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.engine import cpu_kernels
from spinwheel.engine.attention import PagedAttentionMetadata, paged_attention, write_kv
from spinwheel.models.transformer import RMSNorm, Transformer

MAX_TOKENS = 512  # steps with more flat tokens than this run the model's own forward (X @ W^T is as fast there)


def supports(model: Transformer) -> bool:
    """True when every layer is the plain model (no wrapped or sharded projections) on a CPU in fp32."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    if type(model.lm_head) is not nn.Linear or type(model.norm) is not RMSNorm:
        return False
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        linears = (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not nn.Linear for m in linears):
            return False
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return False
    return True


def _rms_norm_t(x_t: torch.Tensor, norm: RMSNorm, fused: bool) -> torch.Tensor:
    """RMSNorm of the columns of x_t (C, N)."""
    if fused:
        return cpu_kernels.rms_norm_t(x_t, norm.weight, norm.eps)
    inv = x_t.pow(2).mean(0, keepdim=True).add_(norm.eps).rsqrt_()  # (1, N)
    return (x_t * inv).mul_(norm.weight[:, None])


def _proj_t(linear: nn.Linear, x_t: torch.Tensor) -> torch.Tensor:
    """(W @ X^T) (+ bias): x_t (in, N) -> (out, N)."""
    if linear.bias is None:
        return torch.mm(linear.weight, x_t)
    return torch.addmm(linear.bias[:, None], linear.weight, x_t)


def _add_proj_t(x_t: torch.Tensor, linear: nn.Linear, a_t: torch.Tensor) -> None:
    """x_t += W @ a_t (+ bias), in place (the residual add folded into the GEMM)."""
    x_t.addmm_(linear.weight, a_t)
    if linear.bias is not None:
        x_t.add_(linear.bias[:, None])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (N, heads, D) (any strides) with cos/sin (N, D/2) -> contiguous (N, heads, D)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def hidden_states_t(model: Transformer, input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: PagedAttentionMetadata, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                    fused: bool) -> torch.Tensor:
    """input_ids, positions (N,) -> final normalised hidden states transposed, (C, N). New K/V go to the caches
    at ``meta.slot_mapping`` (the runner has checked those slots). ``fused``: use the C kernels of
    :mod:`spinwheel.engine.cpu_kernels` for RMSNorm and RoPE + K/V writes, else PyTorch ops."""
    n = input_ids.shape[0]
    x_t = model.embed_tokens.weight.index_select(0, input_ids).t().contiguous()  # (C, N)
    freqs = positions.float()[:, None] * model.rotary.inv_freq.float()  # (N, D/2)
    cos, sin = freqs.cos(), freqs.sin()
    for i, layer in enumerate(model.layers):
        att, mlp = layer.self_attn, layer.mlp
        d = att.head_dim
        h_t = _rms_norm_t(x_t, layer.input_layernorm, fused)
        q_t, k_t, v_t = _proj_t(att.q_proj, h_t), _proj_t(att.k_proj, h_t), _proj_t(att.v_proj, h_t)
        if fused and att.q_norm is None:
            q, k, v = cpu_kernels.rope_qkv_t(q_t, k_t, v_t, cos, sin, k_caches[i], v_caches[i], meta.slot_mapping)
        else:
            q, k, v = (t.t().view(n, -1, d) for t in (q_t, k_t, v_t))  # (N, heads, D) views
            if att.q_norm is not None and att.k_norm is not None:
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            write_kv(k_caches[i], v_caches[i], k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, k_caches[i], v_caches[i], meta, kv_written=True)  # (N, H, D)
        _add_proj_t(x_t, att.o_proj, out.view(n, -1).t())
        h_t = _rms_norm_t(x_t, layer.post_attention_layernorm, fused)
        g = F.silu(_proj_t(mlp.gate_proj, h_t), inplace=True)
        _add_proj_t(x_t, mlp.down_proj, g.mul_(_proj_t(mlp.up_proj, h_t)))
    return _rms_norm_t(x_t, model.norm, fused)


def lm_head_rows(model: Transformer, hidden_t: torch.Tensor) -> torch.Tensor:
    """Logits (R, V) of the columns of hidden_t (C, R), as W @ H^T (see the module docstring)."""
    return torch.mm(model.lm_head.weight, hidden_t).t().contiguous()
