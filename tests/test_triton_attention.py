"""The Triton paged attention kernels (spinwheel/engine/kernels/triton_attention.py) against plain softmax(QK^T)V over
each
whole sequence and against the engine's gather path, on mixed batches: several sequences of different lengths,
partial last blocks, blocks scattered in the pool, GQA and MHA, block sizes 8/16/32, fp32 to 1e-5.

Without a GPU the kernels run on CPU tensors under Triton's interpreter: ``TRITON_INTERPRET=1`` is set when this
module is imported, before anything imports triton, since ``triton.jit`` reads it when it decorates (triton's own
``tl.*`` helpers at ``import triton``). On a GPU the kernels run compiled on CUDA tensors
(``scripts/device_check.sh``). Shapes are small: the interpreter runs every
program of the grid in Python.
"""

import importlib
import os
import sys

import pytest
import torch

from spinwheel.engine.kernels.attention import (
    DecodeBucket,
    PagedAttentionMetadata,
    PrefillSpan,
    gather_attention,
    write_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_TRITON_IMPORTED_EARLIER = "triton" in sys.modules
if DEVICE == "cpu":
    # Before triton is imported anywhere: triton.jit reads it when it decorates, triton's own tl.* helpers too. It
    # stays set for the session (collection imports every test module first anyway); nothing else uses triton on CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def ta():
    """The kernels' module: interpreted on CPU, compiled on CUDA (unless TRITON_INTERPRET=1 is set there)."""
    triton = pytest.importorskip("triton", reason="triton is not installed (`pip install triton`): kernels untested")
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(triton.language.zeros, InterpretedFunction) == interpreted, (
        f"triton was imported before TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')} was set "
        f"(already imported when this module was: {_TRITON_IMPORTED_EARLIER}): set it before anything imports triton"
    )
    module = importlib.import_module("spinwheel.engine.kernels.triton_attention")
    if isinstance(module._decode_kernel, InterpretedFunction) != interpreted:  # imported earlier in another mode
        module = importlib.reload(module)
    return module


def _reference(q, k, v, offset):
    """softmax(QK^T / sqrt(D))V, causal, for queries at positions offset.. over keys 0..T-1: q (Tq, H, D), k/v (T, G, D)
    -> (Tq, H, D), in float64 then float32."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    qpos = torch.arange(q.shape[0], device=q.device)[:, None] + offset
    scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def _batch(lens_cached_new, h, g, d, bs, extra_blocks=5, dtype=torch.float32):
    """Sequences (total, cached, new) on scattered blocks of fresh caches, every token's K/V already written
    (the engine writes this step's K/V before attention) -> caches and per-sequence (q, k, v, table)."""
    num_blocks = sum(-(-t // bs) for t, _, _ in lens_cached_new) + extra_blocks
    k_cache = torch.randn(num_blocks, bs, g, d, device=DEVICE, dtype=dtype)  # garbage where no sequence writes
    v_cache = torch.randn(num_blocks, bs, g, d, device=DEVICE, dtype=dtype)
    perm = torch.randperm(num_blocks).tolist()
    seqs = []
    for total, cached, new in lens_cached_new:
        table = [perm.pop() for _ in range(-(-total // bs))]
        q, k, v = (torch.randn(total, n, d, device=DEVICE, dtype=dtype) for n in (h, g, g))
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)], device=DEVICE)
        write_kv(k_cache, v_cache, k, v, slots)
        seqs.append((total, cached, new, table, q, k, v))
    return k_cache, v_cache, seqs


@pytest.mark.parametrize(
    "h, g, d, bs, block_n",
    [(4, 2, 16, 8, 64), (4, 4, 32, 16, 16), (8, 2, 16, 32, 16), (6, 1, 24, 16, 32)],
    ids=["gqa2-bs8", "mha-bs16", "gqa4-bs32-tile-in-block", "gqa6-d24-bs16"],
)
def test_triton_decode_matches_reference(ta, h, g, d, bs, block_n):
    """One token per sequence; contexts of 1 key, a full block, a block + 1, partial blocks and several tiles;
    the bucket starts at row 2 of q, so the kernel must honour ``row0`` and leave other rows alone."""
    torch.manual_seed(1)
    lens = [1, bs, bs + 1, 3 * bs - 2, 77, 5]
    k_cache, v_cache, seqs = _batch([(n, n - 1, 1) for n in lens], h, g, d, bs)
    max_blocks = max(len(s[3]) for s in seqs)
    tables = torch.tensor([s[3] + [0] * (max_blocks - len(s[3])) for s in seqs], device=DEVICE)
    q = torch.randn(len(lens) + 3, h, d, device=DEVICE)
    q[2 : 2 + len(lens)] = torch.stack([s[4][-1] for s in seqs])
    out = torch.full_like(q, float("nan"))
    ta.paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens, device=DEVICE), out, row0=2, block_n=block_n)
    expected = torch.stack([_reference(s[4][-1:], s[5], s[6], s[0] - 1)[0] for s in seqs])
    torch.testing.assert_close(out[2 : 2 + len(lens)], expected, atol=1e-5, rtol=1e-5)
    assert out[:2].isnan().all() and out[2 + len(lens) :].isnan().all()


@pytest.mark.parametrize(
    "h, g, d, bs, rows",
    [(4, 2, 16, 8, 16), (2, 2, 32, 16, 64), (8, 2, 16, 32, 16)],
    ids=["gqa2-bs8-8tok-tiles", "mha-bs16", "gqa4-bs32-4tok-tiles"],
)
def test_triton_prefill_matches_reference(ta, h, g, d, bs, rows):
    """Spans (total, cached, new): a fresh prompt, chunks after a cached prefix that ends mid-block and on a block
    boundary, a one-token span, a long chunk over several query tiles; causal within each span."""
    torch.manual_seed(2)
    specs = [(13, 0, 13), (23, 10, 13), (2 * bs + 5, bs, bs + 5), (9, 8, 1), (40, 3, 37)]
    k_cache, v_cache, seqs = _batch(specs, h, g, d, bs)
    spans, row = [], 0
    for total, cached, new, table, *_ in seqs:
        spans.append(PrefillSpan(row, new, total, torch.tensor(table, device=DEVICE)))
        row += new
    q = torch.cat([s[4][s[1] :] for s in seqs])
    out = torch.full_like(q, float("nan"))
    batch = ta.pack_prefill_spans(spans, q.device)
    ta.paged_prefill(q, k_cache, v_cache, batch, out, block_n=16, rows_per_program=rows)
    expected = torch.cat([_reference(s[4][s[1] :], s[5], s[6], s[1]) for s in seqs])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_step_matches_gather_path(ta, dtype):
    """A whole engine step (two decode buckets, then prefill chunks) through the Triton path and the gather path
    of spinwheel.engine.kernels.attention: same output to 1e-5 in fp32. In fp16 (half-precision tiles, fp32 softmax) to
    the
    fp64 reference within fp16 rounding; bf16 runs on GPUs only: triton 3.9's interpreter multiplies bf16 wrongly."""
    torch.manual_seed(3)
    h, g, d, bs = 4, 2, 16, 16
    specs = [(9, 8, 1), (40, 39, 1), (1, 0, 1), (17, 16, 1), (20, 0, 20), (30, 12, 18)]
    k_cache, v_cache, seqs = _batch(specs, h, g, d, bs, dtype=dtype)
    buckets = []
    for start, part in ((0, seqs[:2]), (2, seqs[2:4])):
        max_blocks = max(len(s[3]) for s in part)
        tables = torch.tensor([s[3] + [0] * (max_blocks - len(s[3])) for s in part], device=DEVICE)
        lens = torch.tensor([s[0] for s in part], device=DEVICE)
        missing = torch.arange(max_blocks * bs, device=DEVICE)[None] >= lens[:, None]
        bias = torch.zeros(missing.shape, device=DEVICE).masked_fill(missing, float("-inf"))[:, None, None]
        buckets.append(DecodeBucket(start, tables, bias, lens))
    spans = [PrefillSpan(4, 20, 20, torch.tensor(seqs[4][3], device=DEVICE))]
    spans.append(PrefillSpan(24, 18, 30, torch.tensor(seqs[5][3], device=DEVICE)))
    q, k, v = (torch.cat([s[i][s[1] :] for s in seqs]) for i in (4, 5, 6))
    meta = PagedAttentionMetadata(torch.empty(0, dtype=torch.long), buckets, spans)
    out = ta.paged_attention(q, k_cache, v_cache, meta)
    assert meta.triton_prefill is not None and out.dtype == dtype  # packed once, for the step's other layers
    expected = torch.cat([_reference(s[4][s[1] :], s[5], s[6], s[1]) for s in seqs])
    if dtype == torch.float32:
        torch.testing.assert_close(out, gather_attention(q, k, v, k_cache, v_cache, meta), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=3e-3)


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine dispatches to Triton on CUDA only")
def test_engine_attention_dispatches_to_triton_on_cuda(ta):
    from spinwheel.engine.kernels.attention import triton_kernels

    assert triton_kernels() is not None, "triton imports here, so CUDA paged attention must use its kernels"
