"""Paged attention kernels in Triton for the engine's CUDA path: attention straight through the block tables.

The plain-PyTorch path of :func:`spinwheel.engine.kernels.attention.paged_attention` gathers (copies) every sequence's
cached blocks into a contiguous tensor before ``scaled_dot_product_attention`` reads them. These kernels read each
key/value row where it lies in the paged cache ``(num_blocks, block_size, G, D)``: a tile of ``BLOCK_N`` key
positions is mapped through the block table position by position (``block_table[pos // block_size]``), so a tile
may span several blocks or part of one, and any block size works. Scores and values are accumulated with an online
softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), in fp32 whatever the cache dtype.

* :func:`paged_decode` — one query token per sequence (a decode bucket): one program per (sequence, KV head) holds
  the ``H // G`` query heads that share that KV head as the rows of its query tile (grouped-query attention
  without repeating K/V; rows padded to 16 for ``tl.dot``), over the sequence's ``context_len`` keys.
* :func:`paged_prefill` — a span of new query tokens per sequence (prefill, chunked prefill, prefix-cache hits):
  its keys are the cached prefix plus the span itself (already written into the cache), causal within the span.
  One program per (span, tile of query tokens, KV head); the tile's rows are (token, query head of the group)
  pairs, and key tiles past the tile's last causal position are never read.

Matrix products use ``input_precision="ieee"``: fp32 stays exact fp32 (no TF32), so the kernels match the gather
path to ~1e-6; bf16/fp16 caches use the tensor cores as usual. This module needs only tensors (no import of
:mod:`spinwheel.engine.kernels.attention`, which imports it lazily on CUDA). Tests run the kernels on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1`` must be set before triton is first imported: ``triton.jit`` reads it
when it decorates, triton's own helpers included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634  # scores are scaled by log2(e) once, so the softmax uses exp2


@triton.jit
def _attend(
    q,  # (M, D_P) query tile, already scaled by sm_scale * log2(e)
    qpos,  # (M,) absolute position of each row's query token: it sees keys at positions <= qpos
    ctx,  # keys of the sequence
    hi,  # key positions read: [0, hi)
    table_ptr,  # this sequence's row of the block table
    k_ptr,  # the caches, offset to this program's KV head
    v_ptr,
    offs_d,
    d_mask,
    stride_kb,
    stride_ks,
    M: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The key loop shared by both kernels -> (unnormalised output (M, D_P), softmax denominators (M,))."""
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, D_P], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < ctx
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # (M, BLOCK_N)
        # key 0 is visible to every row, so the first tile makes each row's running max finite (no inf - inf)
        s = tl.where(valid[None, :] & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, l_i


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    lens_ptr,
    row0,  # first row of the bucket in q / out
    scale,  # sm_scale * log2(e)
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_t,
    stride_kb,
    stride_ks,
    stride_kg,
    D: tl.constexpr,
    D_P: tl.constexpr,
    REP: tl.constexpr,  # query heads per KV head
    REP_P: tl.constexpr,  # REP padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    offs_d = tl.arange(0, D_P)
    d_mask = offs_d < D
    heads = kvh * REP + tl.arange(0, REP_P)
    r_mask = (tl.arange(0, REP_P) < REP)[:, None] & d_mask[None, :]
    row = (row0 + seq).to(tl.int64)
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + offs_d[None, :], mask=r_mask, other=0.0)
    q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
    qpos = tl.zeros([REP_P], dtype=tl.int32) + ctx - 1  # the decode token is the sequence's last
    acc, l_i = _attend(
        q,
        qpos,
        ctx,
        ctx,
        tables_ptr + seq.to(tl.int64) * stride_t,
        k_ptr + kvh * stride_kg,
        v_ptr + kvh * stride_kg,
        offs_d,
        d_mask,
        stride_kb,
        stride_ks,
        REP_P,
        D_P,
        BLOCK_SIZE,
        BLOCK_N,
    )
    out = acc / l_i[:, None]
    o_offs = row * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=r_mask)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    starts_ptr,  # (P,) first row of each span in q / out
    num_tokens_ptr,  # (P,) query tokens of each span
    lens_ptr,  # (P,) keys of each sequence after this step (cached prefix + the span)
    scale,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_t,
    stride_kb,
    stride_ks,
    stride_kg,
    D: tl.constexpr,
    D_P: tl.constexpr,
    REP: tl.constexpr,
    REP_P: tl.constexpr,  # REP padded to a power of two
    BLOCK_M: tl.constexpr,  # query tokens per program; BLOCK_M * REP_P rows, at least 16
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    span = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    n_tok = tl.load(num_tokens_ptr + span)
    if tile * BLOCK_M >= n_tok:  # the grid covers the longest span; shorter spans have spare tiles
        return
    ctx = tl.load(lens_ptr + span)
    offset = ctx - n_tok  # query token i sits at absolute position offset + i
    r = tl.arange(0, BLOCK_M * REP_P)
    tok = tile * BLOCK_M + r // REP_P
    heads = kvh * REP + r % REP_P
    offs_d = tl.arange(0, D_P)
    d_mask = offs_d < D
    r_mask = ((tok < n_tok) & (r % REP_P < REP))[:, None] & d_mask[None, :]
    rows = tl.load(starts_ptr + span).to(tl.int64) + tok
    q = tl.load(
        q_ptr + rows[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :], mask=r_mask, other=0.0
    )
    q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
    acc, l_i = _attend(
        q,
        offset + tok,
        ctx,
        tl.minimum(ctx, offset + (tile + 1) * BLOCK_M),  # keys past the tile's last token are all masked
        tables_ptr + span.to(tl.int64) * stride_t,
        k_ptr + kvh * stride_kg,
        v_ptr + kvh * stride_kg,
        offs_d,
        d_mask,
        stride_kb,
        stride_ks,
        BLOCK_M * REP_P,
        D_P,
        BLOCK_SIZE,
        BLOCK_N,
    )
    out = acc / l_i[:, None]
    o_offs = rows[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=r_mask)


@dataclass
class PrefillBatch:
    """The prefill spans of a step packed into tensors for :func:`paged_prefill` (built once per step, used by
    every layer): ``block_tables`` (P, max_blocks) padded with block 0; starts, num_tokens, context_lens (P,)."""

    starts: torch.Tensor
    num_tokens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_tokens: int  # the longest span: sizes the grid without reading the device


def pack_prefill_spans(spans: list, device: torch.device) -> PrefillBatch:
    """Spans with ``start``, ``num_tokens``, ``context_len`` and a 1-D ``block_table`` (the engine's
    :class:`~spinwheel.engine.kernels.attention.PrefillSpan`) -> one :class:`PrefillBatch`."""
    tables = torch.nn.utils.rnn.pad_sequence([s.block_table.to(device, torch.int64) for s in spans], batch_first=True)
    columns = [[s.start for s in spans], [s.num_tokens for s in spans], [s.context_len for s in spans]]
    starts, num_tokens, lens = torch.tensor(columns, dtype=torch.int64).to(device).unbind(0)  # contiguous rows
    return PrefillBatch(starts, num_tokens, lens, tables, max(s.num_tokens for s in spans))


def _tiles(q: torch.Tensor) -> tuple[int, int]:
    """Default (keys per tile, query rows per prefill program): smaller for fp32, whose exact (non-TF32) products
    need more registers and code (a 64 x 64 fp32 prefill tile compiles to a 1.2 MB cubin for sm_90)."""
    return (32, 32) if q.element_size() >= 4 else (64, 64)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """Shapes and strides the kernels rely on -> (query heads per KV head, padded head dim)."""
    h, d = q.shape[1:]
    g = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != d or h % g or out.shape != q.shape:
        raise ValueError("triton paged attention: inconsistent shapes")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("triton paged attention: the head dim must be contiguous, both caches alike")
    return h // g, max(16, triton.next_power_of_2(d))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    row0: int = 0,
    block_n: int | None = None,
) -> None:
    """Rows ``row0 .. row0 + S`` of q (N, H, D) are one decode token each of S sequences with ``block_tables``
    (S, max_blocks) and ``context_lens`` (S,) (keys, this step's included, already in the caches
    (num_blocks, block_size, G, D)); their attention is written to the same rows of ``out`` (N, H, D)."""
    rep, d_p = _check(q, k_cache, v_cache, out)
    s, g, bs = block_tables.shape[0], k_cache.shape[2], k_cache.shape[1]
    if s == 0:
        return
    _decode_kernel[(s, g)](
        q, k_cache, v_cache, out, block_tables, context_lens, row0, q.shape[2] ** -0.5 * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        D=q.shape[2], D_P=d_p, REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), BLOCK_SIZE=bs,
        BLOCK_N=block_n or _tiles(q)[0],
    )  # fmt: skip


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PrefillBatch,
    out: torch.Tensor,
    block_n: int | None = None,
    rows_per_program: int | None = None,
) -> None:
    """Causal attention of each span's rows of q (N, H, D) over its sequence's cached keys (prefix and the span
    itself, already written into the caches) -> the same rows of ``out`` (N, H, D). ``rows_per_program``: a power
    of two, query rows (token, head) per program."""
    rep, d_p = _check(q, k_cache, v_cache, out)
    rep_p = triton.next_power_of_2(rep)
    block_n, rows_per_program = block_n or _tiles(q)[0], rows_per_program or _tiles(q)[1]
    block_m = max(1, rows_per_program // rep_p, math.ceil(16 / rep_p))
    grid = (batch.starts.shape[0], triton.cdiv(batch.max_tokens, block_m), k_cache.shape[2])
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, batch.block_tables, batch.starts, batch.num_tokens, batch.context_lens,
        q.shape[2] ** -0.5 * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        batch.block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        D=q.shape[2], D_P=d_p, REP=rep, REP_P=rep_p, BLOCK_M=block_m, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
    )  # fmt: skip


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> torch.Tensor:
    """A whole step (a :class:`~spinwheel.engine.kernels.attention.PagedAttentionMetadata`, this step's K/V already in
    the caches): q (N, H, D) -> (N, H, D), decode buckets by :func:`paged_decode`, prefill spans by
    :func:`paged_prefill`. The packed spans are kept on ``meta`` for the step's other layers."""
    out = q.new_empty(q.shape)
    if q.stride(2) != 1:
        q = q.contiguous()
    for b in meta.decodes:
        lens = b.context_lens if b.context_lens is not None else (b.bias[:, 0, 0] == 0).sum(-1)
        paged_decode(q, k_cache, v_cache, b.block_tables, lens, out, row0=b.start)
    if meta.prefills:
        if meta.triton_prefill is None:
            meta.triton_prefill = pack_prefill_spans(meta.prefills, q.device)
        paged_prefill(q, k_cache, v_cache, meta.triton_prefill, out)
    return out
