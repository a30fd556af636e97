"""Paged attention in plain PyTorch (Kwon et al., SOSP 2023), runnable on CPU and GPU.

The KV cache of one layer is a pair of tensors ``(num_blocks, block_size, G, D)``. A step's tokens arrive flattened
(``N`` tokens of all scheduled sequences, decodes first, then prefill chunks); their new K/V are written into the
cache at ``slot_mapping`` (``block_id * block_size + offset``) and each sequence then attends to its own context,
gathered from the cache through its block table:

* decodes (one query token each) on the CPU in fp32 run in one call of the fused C kernel of
  :mod:`spinwheel.engine.kernels.cpu_kernels`, which reads each sequence's blocks in place (no gather);
* elsewhere decodes are batched in buckets of similar context length (the runner sorts them): a bucket's block
  tables are padded to its longest context, the gathered keys are masked past each sequence's length, and one
  ``scaled_dot_product_attention`` call covers the bucket, with the ``H // G`` query heads that share a key/value
  head laid out as that head's "query length";
* prefill chunks run one sequence at a time with a causal mask offset by the tokens already in the cache (chunked
  prefill, prefix-cache hits, recompute); a chunk with no earlier context attends to its own K/V directly.

On CUDA, when Triton imports, :mod:`spinwheel.engine.kernels.triton_attention` runs both instead: its kernels read the
blocks in place through the block tables (no gather). The gather path stays the fallback and the reference
(``tests/test_triton_attention.py`` compares the two, on CPU under Triton's interpreter).

The dense oracle is :class:`spinwheel.models.transformer.SDPAAttention`; tests compare the two to 1e-5.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.engine.kernels.cpu_kernels import paged_decode_attention

logger = logging.getLogger(__name__)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa (torch 2.5+)


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the flat batch
    num_tokens: int  # query tokens in this chunk
    context_len: int  # tokens with K/V after this step (earlier context + this chunk)
    block_table: torch.Tensor  # (num_blocks_of_seq,) int64


@dataclass
class DecodeBucket:
    start: int  # first row in the flat batch; the bucket's S decodes are consecutive rows, one token each
    block_tables: torch.Tensor  # (S, max_blocks) int64, padded with block 0
    # (S, 1, 1, max_blocks * block_size) additive mask: 0 where a key exists, -inf past the end; None when the
    # fused CPU kernel runs the bucket (it reads context_lens instead)
    bias: torch.Tensor | None
    context_lens: torch.Tensor | None = None  # (S,) int64: keys per sequence, this step's token included


@dataclass
class PagedAttentionMetadata:
    """Everything a layer needs to attend through block tables; built once per step by the model runner."""

    slot_mapping: torch.Tensor  # (N,) int64: cache slot of each new token
    decodes: list[DecodeBucket]
    prefills: list[PrefillSpan]
    tables_checked: bool = False  # the runner has range-checked the fused buckets' tables for this step
    triton_prefill: object = None  # the Triton path's packed prefill spans, built by the step's first layer


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys/values (N, G, D) into the cache (num_blocks, block_size, G, D)."""
    g, d = k.shape[-2:]
    k_cache.view(-1, g, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, g, d).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache (num_blocks, block_size, G, D), block_ids (...,) -> (..., block_size, G, D). ``index_select`` on a 2-D
    view copies whole blocks as rows, much faster on CPU than advanced indexing."""
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape, *cache.shape[1:])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    kv_written: bool = False,
) -> torch.Tensor:
    """q (N, H, D), k/v (N, G, D) of this step's tokens (RoPE applied) -> (N, H, D). ``kv_written``: k and v are
    in the cache at ``meta.slot_mapping`` already (the fused RoPE kernel writes them)."""
    if not kv_written:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    # --- Triton dispatch (CUDA only): kernels that read the paged cache in place; the gather path is the fallback
    if q.is_cuda and (kernels := triton_kernels()) is not None:
        return kernels.paged_attention(q, k_cache, v_cache, meta)
    return gather_attention(q, k, v, k_cache, v_cache, meta)


@functools.cache
def triton_kernels() -> ModuleType | None:
    """:mod:`spinwheel.engine.kernels.triton_attention` where triton imports, else ``None`` (the gather path runs).
    Imported on first CUDA use only: under ``TRITON_INTERPRET=1`` the kernels must be decorated after it is set."""
    try:
        from spinwheel.engine.kernels import triton_attention
    except ImportError as e:
        logger.info("triton is not importable (%s): CUDA paged attention gathers blocks with PyTorch", e)
        return None
    return triton_attention


def gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
) -> torch.Tensor:
    """The PyTorch path of :func:`paged_attention` (this step's K/V already in the caches): decode buckets by the
    fused CPU kernel or gathered blocks and SDPA, prefill chunks by SDPA over gathered blocks."""
    n, h, d = q.shape
    g, bs = k_cache.shape[2], k_cache.shape[1]
    rep = h // g
    out = q.new_empty(n, h, d)
    for b in meta.decodes:
        nd, t = b.block_tables.shape[0], b.block_tables.shape[1] * bs
        rows = slice(b.start, b.start + nd)
        if b.bias is None:  # fused kernel: reads the blocks in place and writes its rows of `out`
            assert b.context_lens is not None
            paged_decode_attention(
                q[rows].contiguous(),
                k_cache,
                v_cache,
                b.block_tables,
                b.context_lens,
                out[rows],
                checked=meta.tables_checked,
            )
            continue
        keys = gather_blocks(k_cache, b.block_tables).view(nd, t, g, d).transpose(1, 2)  # (S, G, T, D)
        values = gather_blocks(v_cache, b.block_tables).view(nd, t, g, d).transpose(1, 2)
        qd = q[rows].view(nd, g, rep, d)  # the query heads of one kv head as its "query length"
        od = F.scaled_dot_product_attention(qd, keys, values, attn_mask=b.bias)  # (S, G, rep, D)
        out[rows] = od.reshape(nd, h, d)
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        qp = q[rows].transpose(0, 1)[None]  # (1, H, Tq, D)
        if p.context_len == p.num_tokens:  # nothing earlier in the cache: plain causal attention on this chunk
            kp, vp, mask, causal = k[rows], v[rows], None, True
        else:
            kp = gather_blocks(k_cache, p.block_table).view(-1, g, d)[: p.context_len]  # (Tk, G, D)
            vp = gather_blocks(v_cache, p.block_table).view(-1, g, d)[: p.context_len]
            offset = p.context_len - p.num_tokens  # query i sits at absolute position offset + i
            qpos = torch.arange(p.num_tokens, device=q.device)[:, None] + offset
            mask, causal = torch.arange(p.context_len, device=q.device)[None, :] <= qpos, False
        kp, vp = kp.transpose(0, 1), vp.transpose(0, 1)  # (G, Tk, D)
        if rep > 1 and _SDPA_GQA:  # grouped-query attention inside SDPA: nothing repeated
            op = F.scaled_dot_product_attention(
                qp, kp[None], vp[None], attn_mask=mask, is_causal=causal, enable_gqa=True
            )
        else:
            if rep > 1:
                kp, vp = kp.repeat_interleave(rep, dim=0), vp.repeat_interleave(rep, dim=0)
            op = F.scaled_dot_product_attention(qp, kp[None], vp[None], attn_mask=mask, is_causal=causal)
        out[rows] = op[0].transpose(0, 1)
    return out


class PagedAttention(nn.Module):
    """Drop-in for ``Attention.core``: paged attention when the engine passes :class:`PagedAttentionMetadata`,
    the original kernel otherwise — so a model shared with a trainer keeps training exactly as before."""

    def __init__(self, fallback: nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        super().__init__()
        self.fallback = fallback
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object, layer_idx: int) -> torch.Tensor:
        if not isinstance(meta, PagedAttentionMetadata):
            return self.fallback(q, k, v, meta, layer_idx)
        # the engine runs one flat "batch" of shape (1, N, ...)
        return paged_attention(q[0], k[0], v[0], self.k_cache, self.v_cache, meta)[None]
