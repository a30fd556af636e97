"""Paged attention against the dense oracle (causal SDPA over each whole sequence)."""

import shutil

import pytest
import torch

from spinwheel.engine.kernels.attention import DecodeBucket, PagedAttentionMetadata, PrefillSpan, paged_attention
from spinwheel.engine.kernels.cpu_kernels import load_kernels, paged_decode_attention
from spinwheel.models.transformer import SDPAAttention


def _dense(q, k, v):
    """q (T, H, D), k/v (T, G, D) of one whole sequence -> (T, H, D) with the model's own kernel."""
    return SDPAAttention()(q[None], k[None], v[None], None, 0)[0]


def _require_kernel() -> None:
    """Skip only where no C compiler exists; with a compiler, a kernel that fails to build is a failure."""
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler for the fused CPU kernel")
    assert load_kernels() is not None, "a C compiler exists but the fused CPU kernel did not build"


@pytest.mark.parametrize("fused", [False, True], ids=["pytorch-buckets", "fused-cpu-kernel"])
def test_paged_attention_matches_dense_on_mixed_batch(fused):
    if fused:
        _require_kernel()
    torch.manual_seed(0)
    h, g, d, bs, num_blocks = 4, 2, 8, 4, 64
    k_cache, v_cache = torch.zeros(num_blocks, bs, g, d), torch.zeros(num_blocks, bs, g, d)
    perm = torch.randperm(num_blocks).tolist()  # scattered physical blocks
    # (total tokens, tokens already cached, tokens in this step): decodes, a fresh prefill, a chunk with context
    specs = [(9, 8, 1), (17, 16, 1), (1, 0, 1), (4, 3, 1), (13, 0, 13), (23, 10, 13), (6, 5, 1)]
    specs.sort(key=lambda s: s[2] > 1)  # decodes first, as the runner lays them out
    seqs = []
    for total, cached, new in specs:
        nb = -(-total // bs)
        table = [perm.pop() for _ in range(nb)]
        q, k, v = torch.randn(total, h, d), torch.randn(total, g, d), torch.randn(total, g, d)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(total)])
        k_cache.view(-1, g, d)[slots[:cached]] = k[:cached]  # earlier steps' K/V
        v_cache.view(-1, g, d)[slots[:cached]] = v[:cached]
        seqs.append((total, cached, new, table, q, k, v, slots))
    decodes = [s for s in seqs if s[2] == 1]
    buckets = []
    for start, part in ((0, decodes[:3]), (3, decodes[3:])):  # two buckets, as the runner makes them
        max_blocks = max(len(s[3]) for s in part)
        tables = torch.tensor([s[3] + [0] * (max_blocks - len(s[3])) for s in part])
        lens = torch.tensor([s[0] for s in part])
        bias = torch.zeros(len(part), max_blocks * bs).masked_fill(
            torch.arange(max_blocks * bs)[None] >= lens[:, None], float("-inf")
        )[:, None, None]
        buckets.append(DecodeBucket(start, tables, None if fused else bias, lens))
    spans, row = [], len(decodes)
    for total, cached, new, table, *_ in seqs[len(decodes) :]:
        spans.append(PrefillSpan(row, new, total, torch.tensor(table)))
        row += new
    q = torch.cat([s[4][s[1] :] for s in seqs])
    k = torch.cat([s[5][s[1] :] for s in seqs])
    v = torch.cat([s[6][s[1] :] for s in seqs])
    slot_mapping = torch.cat([s[7][s[1] :] for s in seqs])
    meta = PagedAttentionMetadata(slot_mapping, buckets, spans)
    out = paged_attention(q, k, v, k_cache, v_cache, meta)
    expected = torch.cat([_dense(s[4], s[5], s[6])[s[1] :] for s in seqs])
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the new tokens were written into their slots
    torch.testing.assert_close(k_cache.view(-1, g, d)[slot_mapping], k)


@pytest.mark.parametrize(
    "h, g, d, bs, scale",
    [
        (8, 4, 64, 16, 1.0),
        (6, 6, 16, 4, 1.0),
        (12, 2, 32, 8, 1.0),
        (4, 2, 128, 16, 1.0),
        (4, 1, 48, 8, 1.0),
        (4, 2, 24, 4, 1.0),
        (8, 4, 64, 16, 25.0),
    ],
)
def test_fused_decode_kernel_matches_dense(h, g, d, bs, scale):
    """The C kernel alone, over many sequences (several threads' shares), MHA and GQA, long and 1-token contexts;
    head dims 64 and 128 (specialised vector code), 16/32/48 (vector code) and 24 (scalar code); ``scale`` makes
    the scores spread over a range where most softmax terms underflow."""
    _require_kernel()
    torch.manual_seed(1)
    lens = [1, 2, bs, bs + 1, 3 * bs - 1, 37, 200, 5, 64, 129]
    num_blocks = sum(-(-n // bs) for n in lens) + 7
    k_cache, v_cache = torch.randn(num_blocks, bs, g, d), torch.randn(num_blocks, bs, g, d)
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max(-(-n // bs) for n in lens)
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in lens]
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    q = torch.randn(len(lens), h, d) * scale
    out = torch.full_like(q, float("nan"))
    for threads in (1, 2, 3):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            paged_decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(lens), out)
        finally:
            torch.set_num_threads(prev)
        for i, (n, t) in enumerate(zip(lens, tables)):
            keys = k_cache[torch.tensor(t)].reshape(-1, g, d)[:n]  # (n, G, D) in order
            values = v_cache[torch.tensor(t)].reshape(-1, g, d)[:n]
            qs = torch.zeros(n, h, d)
            qs[-1] = q[i]  # the decode query is the sequence's last token
            expected = _dense(qs, keys, values)[-1]
            torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)


def test_fused_decode_kernel_rejects_out_of_range_tables():
    _require_kernel()
    k_cache = v_cache = torch.zeros(4, 4, 1, 8)
    q, out = torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="out of range"):
        paged_decode_attention(q, k_cache, v_cache, torch.tensor([[4]]), torch.tensor([3]), out)
    with pytest.raises(ValueError, match="out of range"):
        paged_decode_attention(q, k_cache, v_cache, torch.tensor([[0]]), torch.tensor([5]), out)
