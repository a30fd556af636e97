"""RL weight sync: every rank gathering the full model into its engine copy (the default under torchrun) against
``--engine-tp 2`` (engines of 2 ranks each, resharded into: one on 2 ranks, two on 4), on gloo ranks of this CPU.

    python benchmarks/rl_engine_tp.py [--model small] [--steps 3] [--nproc 2] [--layouts zero3 fsdp tp2 dp2]
    python benchmarks/rl_engine_tp.py --nproc 4 --layouts zero3 fsdp hsdp tp2 zero3_tp2 ddp

GRPO on the built-in 1-digit task (4 prompts × 4 completions, 8 new tokens, fp32). Per layout and sync mode: each
rank's engine weights (MiB), the most a rank materialised at once during a sync (the gathered unit; the default
path holds the full copy and gathers the full state dict), the sync's and the rollout's seconds (medians over the
steps; with ``--engine-tp`` also each rank's sync seconds at the last step), and whether the rewards and losses
equal one process's (rewards exactly, losses to 1e-5 relative).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from spinwheel.engine.config import EngineConfig
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.rl.llm import RLConfig, train_rl
from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.train.metrics import read_metrics

LAYOUTS = {
    "zero3": dict(zero=3),
    "fsdp": dict(fsdp=True),
    "hsdp": dict(fsdp=True, hsdp=2),  # shards over 2 ranks, replicas over the rest
    "tp2": dict(tp=2),  # × dp: the rest
    "zero3_tp2": dict(zero=3, tp=2),
    "dp2": dict(dp=2),  # DDP on 2 ranks
    "ddp": dict(),  # DDP over the world
}


def config(out: str, model: str, steps: int, parallel: dict | None = None, engine_tp: int = 1) -> RLConfig:
    return RLConfig(
        model=model,
        out_dir=out,
        steps=steps,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=8,
        lr=1e-3,
        eval_every=0,
        eval_examples=1,
        save_every=0,
        progress=False,
        num_threads=1,
        task=ArithmeticConfig(num_digits=1, num_train=40, num_test=8),
        parallel=ParallelConfig(**(parallel or {})),
        engine=EngineConfig(cpu_packed_weights=False, tensor_parallel_size=engine_tp),
    )


def worker(rank: int, world: int, root: str, model: str, steps: int, layouts: list[str]) -> None:
    for name in layouts:
        for engine_tp in (1, 2):
            train_rl(config(f"{root}/{name}-{engine_tp}", model, steps, LAYOUTS[name], engine_tp))


def records(path: str) -> list[dict]:
    return [r for r in read_metrics(path) if "reward_mean" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (engines of TP 2: nproc / 2 of them)")
    parser.add_argument("--layouts", nargs="+", default=["zero3", "fsdp", "tp2", "dp2"], choices=list(LAYOUTS))
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="rl_engine_tp-")
    train_rl(config(f"{root}/one", args.model, args.steps))
    ref = records(f"{root}/one/metrics.jsonl")
    spawn(worker, args.nproc, args=(root, args.model, args.steps, args.layouts), timeout_s=3000)
    ranks = " / ".join(str(k) for k in range(args.nproc))
    print(
        f"| layout | engine | engine weights per rank (MiB) | peak materialised in sync, rank {ranks} (MiB) "
        f"| sync s | sync s, rank {ranks} | generate s | = one process |"
    )
    print("|---|---|---:|---|---:|---|---:|:---:|")
    for name in args.layouts:
        for engine_tp in (1, 2):
            recs = records(f"{root}/{name}-{engine_tp}/metrics.jsonl")
            same = [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in ref] and all(
                abs(r["loss"] - q["loss"]) <= 1e-5 * abs(q["loss"]) + 1e-7 for r, q in zip(recs, ref)
            )
            copy_mb = recs[-1]["engine_copy_mb"]
            if engine_tp == 1:  # the full copy, and the full state dict gathered into it
                peak = f"{copy_mb:.2f} copy + {copy_mb:.2f} gathered" if copy_mb else "0 (shares the weights)"
                engine, per_rank = "full copy per rank", "-"
            else:
                peak = " / ".join(f"{recs[-1][f'engine_sync_peak_mb/rank{k}']:.2f}" for k in range(args.nproc))
                per_rank = " / ".join(f"{recs[-1][f'engine_sync_s/rank{k}']:.4f}" for k in range(args.nproc))
                engine = "--engine-tp 2"
            sync, generate = (statistics.median(r[f"time/{k}"] for r in recs) for k in ("sync", "generate"))
            row = f"| {name} | {engine} | {copy_mb:.2f} | {peak} | {sync:.4f} | {per_rank} | {generate:.2f} | {same} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
