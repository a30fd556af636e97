"""Paged attention on CUDA: the Triton kernels (spinwheel/engine/kernels/triton_attention.py, blocks read in place
through
the block tables) against the gather path of spinwheel/engine/kernels/attention.py (blocks copied, then SDPA), on one
decode
step (a bucket of sequences with one query token each) and one prefill step (chunks after a cached prefix), the
caches' blocks scattered in the pool as the engine's are.

Prints for each step: milliseconds per call of each path, the speed-up and the largest difference between the two
outputs. Without CUDA, or where triton does not import, it times the gather path only (on CPU the kernels run only
under Triton's interpreter, whose timings mean nothing).

    python benchmarks/paged_attention.py            # Llama-8B-like heads (32 on 8, head dim 128), bf16
    python benchmarks/paged_attention.py --small    # a quick smoke configuration
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from spinwheel.engine.kernels.attention import (
    DecodeBucket,
    PagedAttentionMetadata,
    PrefillSpan,
    gather_attention,
    triton_kernels,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--decode-seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=2048, help="decode contexts are drawn from [0.9x, 1x] of this")
    p.add_argument("--prefill-spans", type=int, default=4)
    p.add_argument("--prefill-cached", type=int, default=1024, help="cached prefix tokens of each prefill span")
    p.add_argument("--prefill-new", type=int, default=512, help="new tokens of each prefill span")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--small", action="store_true", help="8 decodes of ~256 keys, 2 spans of 64 after 128 cached")
    args = p.parse_args()
    if args.small:
        args.decode_seqs, args.context, args.prefill_spans, args.prefill_cached, args.prefill_new = 8, 256, 2, 128, 64
        args.iters = 10
    return args


def build_steps(args: argparse.Namespace, dev: torch.device):
    """Random caches and the q/k/v and metadata of a decode step and of a prefill step over scattered blocks."""
    bs, g, d, dtype = args.block_size, args.kv_heads, args.head_dim, getattr(torch, args.dtype)
    dec_lens = torch.randint(int(0.9 * args.context), args.context + 1, (args.decode_seqs,)).tolist()
    pre_lens = [args.prefill_cached + args.prefill_new] * args.prefill_spans
    num_blocks = sum(-(-n // bs) for n in dec_lens + pre_lens) + 1
    k_cache = torch.randn(num_blocks, bs, g, d, device=dev, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, g, d, device=dev, dtype=dtype)
    perm = torch.randperm(num_blocks).tolist()
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in dec_lens + pre_lens]

    def slots(table: list[int], positions: range) -> torch.Tensor:
        return torch.tensor([table[p // bs] * bs + p % bs for p in positions], device=dev)

    def step(slot_mapping: torch.Tensor, meta: PagedAttentionMetadata):
        q = torch.randn(len(slot_mapping), args.heads, d, device=dev, dtype=dtype)
        k, v = k_cache.view(-1, g, d)[slot_mapping], v_cache.view(-1, g, d)[slot_mapping]  # K/V already written
        return q, k, v, meta

    width = max(-(-n // bs) for n in dec_lens)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[: len(dec_lens)]], device=dev)
    lens = torch.tensor(dec_lens, device=dev)
    missing = torch.arange(width * bs, device=dev)[None] >= lens[:, None]
    bias = torch.zeros(missing.shape, dtype=dtype, device=dev).masked_fill_(missing, float("-inf"))[:, None, None]
    dec_slots = torch.cat([slots(t, range(n - 1, n)) for t, n in zip(tables, dec_lens)])
    decode = step(dec_slots, PagedAttentionMetadata(dec_slots, [DecodeBucket(0, block_tables, bias, lens)], []))
    spans, pre_slots = [], []
    for i, (t, n) in enumerate(zip(tables[len(dec_lens) :], pre_lens)):
        spans.append(PrefillSpan(i * args.prefill_new, args.prefill_new, n, torch.tensor(t, device=dev)))
        pre_slots.append(slots(t, range(args.prefill_cached, n)))
    pre_slots = torch.cat(pre_slots)
    prefill = step(pre_slots, PagedAttentionMetadata(pre_slots, [], spans))
    return k_cache, v_cache, {"decode": decode, "prefill": prefill}


def time_ms(fn, iters: int, dev: torch.device) -> float:
    for _ in range(3):  # warm-up (and Triton's compile on the first call)
        fn()
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    args = parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    kernels = (
        triton_kernels() if dev.type == "cuda" else None
    )  # spinwheel.engine.kernels.triton_attention, if it imports
    if kernels is None:
        why = "triton does not import" if dev.type == "cuda" else "no CUDA device (on CPU Triton only interprets)"
        print(f"{why}: timing the gather path only")
    k_cache, v_cache, steps = build_steps(args, dev)
    print(
        f"heads {args.heads} on {args.kv_heads}, head dim {args.head_dim}, block size {args.block_size}, "
        f"{args.dtype}; decode: {args.decode_seqs} seqs x ~{args.context} keys; prefill: {args.prefill_spans} "
        f"spans x {args.prefill_new} new after {args.prefill_cached} cached"
    )
    print(f"{'step':<8} {'gather ms':>10} {'triton ms':>10} {'speed-up':>9} {'max |diff|':>11}")
    with torch.inference_mode():
        for name, (q, k, v, meta) in steps.items():
            gather = functools.partial(gather_attention, q, k, v, k_cache, v_cache, meta)
            gather_ms = time_ms(gather, args.iters, dev)
            if kernels is None:
                print(f"{name:<8} {gather_ms:>10.3f} {'n/a':>10} {'n/a':>9} {'n/a':>11}")
                continue
            fused = functools.partial(kernels.paged_attention, q, k_cache, v_cache, meta)
            triton_ms = time_ms(fused, args.iters, dev)
            diff = (fused().float() - gather().float()).abs().max().item()
            print(f"{name:<8} {gather_ms:>10.3f} {triton_ms:>10.3f} {gather_ms / triton_ms:>8.2f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
