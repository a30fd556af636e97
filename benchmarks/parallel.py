"""Data-parallel step time: spinwheel's DDP vs ``torch.nn.parallel.DistributedDataParallel`` and spinwheel's FSDP vs
``torch.distributed.fsdp.fully_shard`` (FSDP2), side by side on the same gloo ranks, model, data and seed.

    python benchmarks/parallel.py [--ranks 2] [--steps 20] [--hidden 256] [--layers 4] [--seq 128] [--batch 4]

Speed: each rank builds all four systems; timed steps are interleaved (ours, theirs, ours, …) so machine load hits
both alike, and the median step time is compared. Memory: each system then runs alone in a fresh pair of processes
and reports the growth of peak resident memory (``ru_maxrss``) over a few steps — the CPU has no allocator counter
like ``torch.cuda.max_memory_allocated`` — plus the bytes of parameters, gradients and optimizer state its visible
tensors hold after the optimizer step (torch DDP's internal reducer buckets are not visible, so not counted).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelDims, spawn
from spinwheel.parallel.data.ddp import DistributedDataParallel
from spinwheel.parallel.data.fsdp import FullyShardedDataParallel
from spinwheel.parallel.data.zero import memory_breakdown, optimizer_state_tensors, storage_bytes

SYSTEMS = ("spinwheel-ddp", "torch-ddp", "spinwheel-fsdp", "torch-fsdp2")


def build(name: str, args, dims: ParallelDims):
    config = preset_config(
        "test",
        args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 16 * 16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq,
    )
    model = Transformer(config).init_weights(seed=0)
    if name == "spinwheel-ddp":
        module = DistributedDataParallel(model, dims.dp_axis, dims.comm, bucket_mb=25.0)
    elif name == "torch-ddp":
        module = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25.0)
    elif name == "spinwheel-fsdp":
        module = FullyShardedDataParallel(model, dims.dp_axis, dims.comm, prefetch=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dims.world_size,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        module = model
    params = list(module.parameters())
    opt = (
        torch.optim.AdamW(params, lr=1e-4)
        if not hasattr(module, "make_optimizer")
        else module.make_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    )
    return module, opt


def train_step(module, opt, ids, labels, before_zero_grad=None) -> float:
    logits = module(ids)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    opt.step()
    if before_zero_grad is not None:
        before_zero_grad()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def held_bytes(name: str, module, opt) -> int:
    if name.startswith("spinwheel"):
        return sum(memory_breakdown(module, opt).values())
    params = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()]
    state = [t.to_local() if hasattr(t, "to_local") else t for t in optimizer_state_tensors(opt)]
    return storage_bytes(params) + storage_bytes(grads) + storage_bytes(state)


def batch(args, rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return ids, torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)


def speed(rank: int, world_size: int, args) -> dict:
    dims = ParallelDims.create()
    systems = {name: build(name, args, dims) for name in SYSTEMS}
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for step in range(args.warmup + args.steps):
        ids, labels = batch(args, rank, step)
        for name in SYSTEMS:
            module, opt = systems[name]
            torch.distributed.barrier()
            start = time.perf_counter()
            train_step(module, opt, ids, labels)
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[name].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items()}


def memory(rank: int, world_size: int, args, name: str) -> dict:
    dims = ParallelDims.create()
    module, opt = build(name, args, dims)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = []
    for step in range(3):  # held bytes: after the optimizer step, before zero_grad (gradients still alive)
        train_step(
            module, opt, *batch(args, rank, step), before_zero_grad=lambda: held.append(held_bytes(name, module, opt))
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_growth_mib": (peak - before) / 1024, "held_mib": held[-1] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()
    probe = Transformer(
        preset_config(
            "test",
            args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 8 // 3 // 16 * 16,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 32,
            num_key_value_heads=args.hidden // 64,
        )
    )
    num_params = sum(p.numel() for p in probe.parameters())
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {num_params / 1e6:.2f}M params "
        f"(fp32); batch {args.batch}×{args.seq} tokens per rank; {args.ranks} gloo ranks × {args.threads} "
        f"thread(s); torch {torch.__version__}; {args.warmup} warm-up + {args.steps} timed steps, interleaved"
    )
    times = [spawn(speed, args.ranks, args=(args,), timeout_s=1800, threads=args.threads)]
    per = {name: max(r[name] for r in times[0]) for name in SYSTEMS}  # the slowest rank sets the step time
    mem = {name: spawn(memory, args.ranks, args=(args, name), timeout_s=600, threads=args.threads) for name in SYSTEMS}
    print(f"{'system':<16} {'step ms':>9} {'peak RSS growth MiB (rank 0/1)':>32} {'params+grads+optim MiB':>24}")
    for name in SYSTEMS:
        growth = "/".join(f"{m['peak_rss_growth_mib']:.1f}" for m in mem[name])
        print(f"{name:<16} {per[name] * 1e3:9.1f} {growth:>32} {mem[name][0]['held_mib']:24.2f}")
    print(f"ratio DDP  spinwheel / torch DDP       = {per['spinwheel-ddp'] / per['torch-ddp']:.3f}  (target ≤ 1.10)")
    print(f"ratio FSDP spinwheel / torch FSDP2     = {per['spinwheel-fsdp'] / per['torch-fsdp2']:.3f}  (target ≤ 1.25)")


if __name__ == "__main__":
    main()
