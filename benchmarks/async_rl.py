"""Asynchronous GRPO (``--max-staleness 1``) against the synchronous loop: steady-state steps/s of each, one run
apiece, in one process, and what the overlap leaves to gain.

    .venv/bin/python benchmarks/async_rl.py                         # the demo's GRPO shape: tiny, 64 prompts × 8
    .venv/bin/python benchmarks/async_rl.py --prompts 16 --steps 8  # smaller
    .venv/bin/python benchmarks/async_rl.py --model runs/demo/sft/checkpoint

Both runs use the same model, prompts, reward (the task's exact match), seed and options; the demo's GRPO settings
(G = 8, 8 new tokens, lr 1e-4) unless given. A step's wall time runs from one step's end to the next (the
harness's own bookkeeping included); the first ``--warmup`` steps are left out (the producer starts, the engine
warms up) and steps/s is ``steps / (t_last − t_first)``; the process's CPU seconds over the same steps say whether
the machine had the cores to spare (on a loaded machine both runs are CPU-bound and overlap buys nothing). Also
printed: each run's mean phase times (generate = sampling, train = log-probs + update + sync), the asynchronous run's
``overlap`` ((generate + score + train) / wall: 1 when nothing overlaps) and the share of trained tokens 0 and 1
versions stale.

On a machine with C cores the synchronous loop runs each phase on all of them; the producer and the trainer split
them (C/2 threads each), so the gain is bounded by how much faster two phases on C/2 cores each run than one after
the other on C (on 2 cores torch's 2-thread speed-up is ≈ 1.3–1.6×: at most ≈ 1.25–1.5× with equal phases, less
when one dominates).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spinwheel.rl.llm.loop as loop  # noqa: E402
from spinwheel.rl.llm import RLConfig, train_rl  # noqa: E402
from spinwheel.tasks.arithmetic import ArithmeticConfig  # noqa: E402


def timed_run(args: argparse.Namespace, out: Path, max_staleness: int | None) -> tuple[float, float, list[dict]]:
    """(steady-state steps/s, the process's CPU seconds a step over the same steps, the per-step records) of one
    run."""
    ends: list[tuple[float, float]] = []
    step = loop.RLJob.step

    def timed(self, s):
        record = step(self, s)
        ends.append((time.perf_counter(), time.process_time()))
        return record

    loop.RLJob.step = timed
    try:
        config = RLConfig(
            model=args.model,
            out_dir=str(out),
            steps=args.steps,
            prompts_per_step=args.prompts,
            group_size=8,
            lr=args.lr,
            max_new_tokens=args.max_new_tokens,
            eval_every=0,
            eval_examples=1,
            save_every=0,
            progress=False,
            num_threads=args.threads,
            max_staleness=max_staleness,
            task=ArithmeticConfig(num_digits=2),
        )
        result = train_rl(config)
    finally:
        loop.RLJob.step = step
    (wall0, cpu0), (wall1, cpu1) = ends[args.warmup - 1], ends[-1]
    num = len(ends) - args.warmup
    return num / (wall1 - wall0), (cpu1 - cpu0) / num, result["history"]


def mean(records: list[dict], key: str) -> float:
    values = [r.get(key, 0.0) for r in records]
    return statistics.fmean(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="preset or checkpoint")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (8 completions each)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of steps/s")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the default, one per core)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rates, cpu, histories = {}, {}, {}
        for name, k in (("sync", None), ("K=1", 1)):
            rates[name], cpu[name], histories[name] = timed_run(args, Path(tmp) / name.replace("=", ""), k)
    print(f"{args.model}, {args.prompts} prompts × 8, {args.max_new_tokens} new tokens, {args.steps} steps:")
    for name, recs in histories.items():
        steady = recs[args.warmup :]
        train = sum(mean(steady, f"time/{p}") for p in ("logprobs", "update", "sync"))
        line = (
            f"  {name:>4}: {rates[name]:.3f} steps/s, {cpu[name]:.2f} CPU s a step; "
            f"generate {mean(steady, 'time/generate'):.3f} s, "
            f"score {mean(steady, 'time/score'):.3f} s, train {train:.3f} s a step; "
            f"reward {mean(steady, 'reward_mean'):.3f}"
        )
        if name != "sync":
            line += (
                f"; overlap {mean(steady, 'overlap'):.2f}, trainer waited {mean(steady, 'time/wait_rollout'):.3f} s"
                f", tokens 0 / 1 stale {mean(steady, 'staleness/0'):.2f} / {mean(steady, 'staleness/1'):.2f}"
                f", dropped {sum(r['dropped_samples'] for r in recs):.0f}"
            )
        print(line)
    print(f"  K=1 / sync: {rates['K=1'] / rates['sync']:.2f}x steps/s")


if __name__ == "__main__":
    main()
