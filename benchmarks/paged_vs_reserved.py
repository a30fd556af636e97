"""PagedAttention against Orca's reservation on one fixed KV budget (Kwon et al., SOSP 2023, §3 and §6): the same
engine, model and mixed-length workload run twice in one process — ``kv_allocation="paged"`` (blocks as tokens need
them) and ``kv_allocation="reserved"`` (every block of prompt + max_tokens taken at admission,
:mod:`spinwheel.engine.kv.reservation`) — and the ratios printed.

Modes: paged with recompute preemption (the engine's default), paged with swap preemption, reserved. Prints for
each: the largest and mean batch (sequences per iteration), iterations, preemptions, the KV slots
held per slot filled (reservation's waste) and output tokens/s; then paged/reserved ratios. Requests decode exactly
``max_tokens`` tokens (greedy, EOS ignored): the reservation is Orca's "Oracle" case, its most favourable one, so the
measured gain is a lower bound of what a workload whose outputs stop early would show.

    python benchmarks/paged_vs_reserved.py            # 96 requests, prompts 16-384, outputs 16-384, 512 blocks of 16
    python benchmarks/paged_vs_reserved.py --small    # a quick smoke configuration
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.models import Transformer
from spinwheel.models.presets import preset_config


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="built-in model size (random weights)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--min-len", type=int, default=16, help="shortest prompt and output")
    p.add_argument("--max-len", type=int, default=384, help="longest prompt and output")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=512, help="the fixed KV budget, in blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--small", action="store_true", help="24 requests of 8-64 tokens, 48 blocks, the test preset")
    args = p.parse_args()
    if args.small:
        args.preset, args.requests, args.min_len, args.max_len, args.kv_blocks = "test", 24, 8, 64, 48
    return args


def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request, lengths uniform in [min_len, max_len]."""
    rng = random.Random(args.seed)
    lengths = [(rng.randint(args.min_len, args.max_len), rng.randint(args.min_len, args.max_len)) for _ in range(96)]
    lengths = (lengths * (-(-args.requests // len(lengths))))[: args.requests]
    return [([rng.randrange(3, 250) for _ in range(p)], g) for p, g in lengths]


MODES = {"paged": ("paged", "recompute"), "paged-swap": ("paged", "swap"), "reserved": ("reserved", "recompute")}


def run(model: Transformer, args: argparse.Namespace, requests, mode: str) -> dict:
    allocation, preemption = MODES[mode]
    config = EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        enable_prefix_caching=False,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        kv_allocation=allocation,
        preemption_mode=preemption,
        num_cpu_blocks=args.kv_blocks if preemption == "swap" else None,
    )
    engine = LLMEngine(model, None, config)
    for i, (prompt, g) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=g, ignore_eos=True))
    sched, bm, batches, held, filled = engine.scheduler, engine.block_manager, [], 0, 0
    schedule = sched.schedule

    def counted():
        nonlocal held, filled
        out = schedule()
        batches.append(len(out.scheduled))
        held += bm.num_used_blocks * args.block_size
        filled += sum(s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        return out

    sched.schedule = counted
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - start
    return dict(
        peak=max(batches),
        mean=sum(batches) / len(batches),
        iterations=len(batches),
        preemptions=sched.num_preemptions,
        held_per_filled=held / filled,
        tokens=tokens,
        tokens_per_s=tokens / seconds,
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    vocab = 256
    config = preset_config(args.preset, vocab, max_position_embeddings=2 * args.max_len)
    model = Transformer(config).init_weights(seed=args.seed)
    requests = workload(args)
    print(
        f"model {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), {len(requests)} "
        f"requests, prompt and output lengths uniform in [{args.min_len}, {args.max_len}], KV budget "
        f"{args.kv_blocks} blocks of {args.block_size} tokens, {args.threads} threads"
    )
    run(model, args, requests[:4], "paged")  # warm-up: kernels and thread pools, outside the timings
    # Each mode twice, the second round in reverse order; the faster run of each counts (load only slows).
    res: dict[str, dict] = {}
    for mode in [*MODES, *reversed(MODES)]:
        r = run(model, args, requests, mode)
        if mode not in res or r["tokens_per_s"] > res[mode]["tokens_per_s"]:
            res[mode] = r
    head = ("mode", "peak batch", "mean batch", "iters", "preempt", "held/filled", "tok/s")
    print("{:<11} {:>10} {:>10} {:>6} {:>7} {:>11} {:>8}".format(*head))
    for mode, r in res.items():
        print(
            f"{mode:<11} {r['peak']:>10} {r['mean']:>10.1f} {r['iterations']:>6} {r['preemptions']:>7} "
            f"{r['held_per_filled']:>11.2f} {r['tokens_per_s']:>8.0f}"
        )
    r = res["reserved"]
    for mode in ("paged", "paged-swap"):
        p = res[mode]
        assert p["tokens"] == r["tokens"]
        print(
            f"{mode} / reserved: peak batch {p['peak'] / r['peak']:.2f}x, mean batch {p['mean'] / r['mean']:.2f}x, "
            f"iterations {p['iterations'] / r['iterations']:.2f}x, throughput "
            f"{p['tokens_per_s'] / r['tokens_per_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
