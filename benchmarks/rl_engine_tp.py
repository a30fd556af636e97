"""RL weight sync: every rank gathering the full model into its engine copy (the default under torchrun) against
``--engine-tp 2`` (one engine over both ranks, resharded into), on 2 gloo ranks of this CPU.

    python benchmarks/rl_engine_tp.py [--model small] [--steps 3] [--layouts zero3 fsdp tp2 dp2]

GRPO on the built-in 1-digit task (4 prompts × 4 completions, 8 new tokens, fp32). Per layout and sync mode: each
rank's engine weights (MiB), the most a rank materialised at once during a sync (the gathered unit; the default
path holds the full copy and gathers the full state dict), the sync's and the rollout's seconds (medians over the
steps), and whether the rewards and losses equal one process's (rewards exactly, losses to 1e-5 relative).
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

LAYOUTS = {"zero3": dict(zero=3), "fsdp": dict(fsdp=True), "tp2": dict(tp=2), "dp2": dict(dp=2)}


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
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="rl_engine_tp-")
    train_rl(config(f"{root}/one", args.model, args.steps))
    ref = records(f"{root}/one/metrics.jsonl")
    spawn(worker, 2, args=(root, args.model, args.steps, args.layouts), timeout_s=3000)
    print(
        "| layout | engine | engine weights per rank (MiB) | peak materialised in sync, rank 0 / 1 (MiB) "
        "| sync s | generate s | = one process |"
    )
    print("|---|---|---:|---|---:|---:|:---:|")
    for name in args.layouts:
        for engine_tp in (1, 2):
            recs = records(f"{root}/{name}-{engine_tp}/metrics.jsonl")
            same = [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in ref] and all(
                abs(r["loss"] - q["loss"]) <= 1e-5 * abs(q["loss"]) + 1e-7 for r, q in zip(recs, ref)
            )
            copy_mb = recs[-1]["engine_copy_mb"]
            if engine_tp == 1:  # the full copy, and the full state dict gathered into it
                peak = f"{copy_mb:.2f} copy + {copy_mb:.2f} gathered" if copy_mb else "0 (shares the weights)"
                engine = "full copy per rank"
            else:
                peak = " / ".join(f"{recs[-1][f'engine_sync_peak_mb/rank{k}']:.2f}" for k in range(2))
                engine = "--engine-tp 2"
            sync, generate = (statistics.median(r[f"time/{k}"] for r in recs) for k in ("sync", "generate"))
            print(f"| {name} | {engine} | {copy_mb:.2f} | {peak} | {sync:.4f} | {generate:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
