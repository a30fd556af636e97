"""The weight broadcast of ``--rollout-ranks`` (trainer rank 0 → rollout ranks, flat buckets over gloo): seconds per
update for a model of a given size, by bucket size, between local processes.

    .venv/bin/python benchmarks/weight_broadcast.py                     # 64 Mi fp32 values (256 MiB), 2 ranks
    .venv/bin/python benchmarks/weight_broadcast.py --mib 32 --ranks 3  # smaller, two receivers

The state is a transformer-like list of fp32 tensors (a few large matrices, many small vectors); each timing is one
full broadcast (:func:`~spinwheel.rl.llm.rollouts.rollout_wire.broadcast_weights`, as the run does it after an update,
receivers copying out of each bucket), the median of ``--repeats``, after one warm-up; the receivers' values are
checked against the source's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from spinwheel.parallel import spawn  # noqa: E402
from spinwheel.rl.llm.rollouts.rollout_wire import broadcast_weights  # noqa: E402


def state(mib: float) -> list[torch.Tensor]:
    """About ``mib`` MiB of fp32 tensors: per block 4 matrices and 2 vectors, until the size is reached."""
    g, out, total, width = torch.Generator().manual_seed(0), [], 0, 1024
    while total < mib * 2**20:
        for shape in [(width, width)] * 4 + [(width,)] * 2:
            out.append(torch.randn(*shape, generator=g))
            total += out[-1].numel() * 4
    return out


def worker(rank: int, world: int, mib: float, buckets: list[float], repeats: int) -> dict:
    tensors = state(mib) if rank == 0 else [torch.zeros_like(t) for t in state(mib)]
    send = lambda b: dist.broadcast(b, src=0)  # noqa: E731
    out = {}
    for bucket in buckets:
        times = []
        for i in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            sent = broadcast_weights(tensors, rank == 0, send, bucket_mb=bucket)
            dist.barrier()
            if i:
                times.append(time.perf_counter() - start)
        out[bucket] = (statistics.median(times), sent)
    if rank:
        assert all(torch.equal(a, b) for a, b in zip(tensors, state(mib))), "a receiver got other values"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=256.0, help="model size in MiB (fp32)")
    p.add_argument("--ranks", type=int, default=2, help="processes: 1 source + receivers")
    p.add_argument("--buckets", type=float, nargs="+", default=[4.0, 16.0, 64.0], help="bucket sizes in MiB")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {a.ranks} ranks (gloo, loopback)")
    results = spawn(worker, a.ranks, args=(a.mib, a.buckets, a.repeats), timeout_s=600)[0]
    for bucket, (seconds, sent) in results.items():
        mib = sent / 2**20
        print(f"bucket {bucket:>5g} MiB: {mib:.0f} MiB in {seconds:.3f} s = {mib / seconds:.0f} MiB/s")


if __name__ == "__main__":
    main()
