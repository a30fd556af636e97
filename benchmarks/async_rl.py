"""Asynchronous GRPO (``--max-staleness K``) against the synchronous loop, one run apiece in one process: steady-state
steps/s and samples/s, phase times and what overlap can gain, the staleness of the trained tokens, and — with
``--eval-every`` — the held-out curve: the training seconds to first reach ``--threshold`` and the final figure.

    .venv/bin/python benchmarks/async_rl.py                                   # tiny, 64 prompts × 8: sync vs K=1
    .venv/bin/python benchmarks/async_rl.py --runs sync,k1,k1-recompute,k1-process --steps 12
    .venv/bin/python benchmarks/async_rl.py --model runs/demo/sft/checkpoint --runs sync,k1,k2 \\
        --steps 200 --eval-every 25 --eval-examples 200 --threshold 0.5           # the demo's GRPO, learning

A run is ``sync`` (today's loop) or ``k<K>[-recompute][-process]``: ``--max-staleness K``, ``--kv-on-update
recompute``, ``--rollout-engine process``. Every run uses the same model, prompts, reward (the task's exact match),
seed and the demo's GRPO settings (G = 8, 8 new tokens, lr 1e-4 with cosine decay to 0.1×). A step's wall time runs
from one step's end to the next; the first ``--warmup`` steps are left out of steps/s (``steps / (t_last −
t_first)``); the process's CPU seconds over the same steps say whether the machine had cores to spare (the engine
process's CPU is not in them). Held-out evaluations (greedy, on the test split) are timed and their seconds taken
out of the training clock (a K > 0 producer keeps sampling meanwhile, at most K steps ahead).

The bound: the synchronous loop runs generate (g) then train (t) on all C cores; overlap can at best hide the shorter
phase, (g + t) / max(g, t) — and only if each phase, on its half of the cores, kept its speed. On 2 cores each phase
gets one thread; torch's 2-thread speed-up (≈ 1.3–1.6× here) is lost, which lowers the bound to about
(g + t) / max(g·s_g, t·s_t) with s the phase's slow-down on one thread (measured: ``--threads 1`` sync).
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


def run_options(name: str) -> dict:
    """``sync`` / ``k1`` / ``k2-recompute`` / ``k1-process`` … -> RLConfig options."""
    if name == "sync":
        return {}
    head, *flags = name.split("-")
    if not head.startswith("k") or not head[1:].isdigit() or set(flags) - {"recompute", "process"}:
        raise SystemExit(f"--runs: {name!r} is not sync or k<K>[-recompute][-process]")
    options = {"max_staleness": int(head[1:])}
    if "recompute" in flags:
        options["kv_on_update"] = "recompute"
    if "process" in flags:
        options["rollout_engine"] = "process"
    return options


def timed_run(args: argparse.Namespace, out: Path, name: str) -> dict:
    """One run's figures: step ends (training clock, evaluations taken out), CPU, records, evaluations."""
    ends: list[tuple[float, float]] = []
    evals: list[tuple[int, float, float]] = []  # (step, value, training seconds when it was measured)
    clock: dict[str, float] = {"eval_s": 0.0}
    step, evaluate = loop.RLJob.step, loop.RLJob.evaluate

    def timed_step(self, s):
        clock.setdefault("t0", time.perf_counter())  # no evaluation: from the first step
        record = step(self, s)
        ends.append((time.perf_counter() - clock["eval_s"], time.process_time()))
        return record

    def timed_evaluate(self, s):
        start = time.perf_counter()
        clock.setdefault("t0", start)  # the clock starts at the first evaluation (after the set-up)
        trained = start - clock["t0"] - clock["eval_s"]  # training seconds so far
        value = evaluate(self, s)
        clock["eval_s"] += time.perf_counter() - start
        if value is not None:
            evals.append((s, value, trained))
        return value

    loop.RLJob.step, loop.RLJob.evaluate = timed_step, timed_evaluate
    try:
        config = RLConfig(
            model=args.model,
            out_dir=str(out),
            steps=args.steps,
            prompts_per_step=args.prompts,
            group_size=8,
            lr=args.lr,
            min_lr_ratio=0.1,
            max_new_tokens=args.max_new_tokens,
            eval_every=args.eval_every,
            eval_examples=args.eval_examples,
            save_every=0,
            progress=False,
            num_threads=args.threads,
            seed=args.seed,
            task=ArithmeticConfig(num_digits=2),
            **run_options(name),
        )
        result = train_rl(config)
    finally:
        loop.RLJob.step, loop.RLJob.evaluate = step, evaluate
    (wall0, cpu0), (wall1, cpu1) = ends[args.warmup - 1], ends[-1]
    num = len(ends) - args.warmup
    steps_s = num / (wall1 - wall0)
    records = [r for r in result["history"] if "reward_mean" in r]
    return {
        "steps_s": steps_s,
        "samples_s": steps_s * args.prompts * 8,
        "cpu_s": (cpu1 - cpu0) / num,
        "records": records,
        "evals": evals,
        "train_s": ends[-1][0] - clock["t0"],
    }


def mean(records: list[dict], key: str) -> float:
    values = [r.get(key, 0.0) for r in records]
    return statistics.fmean(values) if values else float("nan")


def report(args: argparse.Namespace, name: str, run: dict) -> str:
    steady = run["records"][args.warmup :]
    g = mean(steady, "time/generate") + mean(steady, "time/score")
    t = sum(mean(steady, f"time/{p}") for p in ("logprobs", "update", "sync"))
    line = (
        f"  {name:>14}: {run['steps_s']:.3f} steps/s = {run['samples_s']:.0f} samples/s, {run['cpu_s']:.2f} CPU s a "
        f"step; generate {g:.3f} s, train {t:.3f} s a step (bound (g+t)/max = {(g + t) / max(g, t):.2f}x)"
    )
    if name != "sync":
        shares = {k: mean(steady, k) for k in sorted({k for r in steady for k in r if k.startswith("staleness/")})}
        stale = ", ".join(f"{k.split('/')[1]}: {v:.2f}" for k, v in shares.items())
        last = run["records"][-1]
        line += (
            f"; overlap {mean(steady, 'overlap'):.2f}, trainer waited {mean(steady, 'time/wait_rollout'):.3f} s; "
            f"tokens by staleness {{{stale}}}, dropped {sum(r['dropped_samples'] for r in run['records']):.0f}, "
            f"kv recomputed {last.get('kv_recomputed', 0):.0f} groups"
        )
        if "weight_publish_mb" in last:
            line += f", weights to the engine process {last['weight_publish_s'] / len(run['records']) * 1e3:.1f} ms"
            line += f" / {last['weight_publish_mb'] / len(run['records']):.1f} MiB an update"
    if run["evals"]:
        curve = " ".join(f"{s}:{v:.3f}@{w:.0f}s" for s, v, w in run["evals"])
        reached = next(((s, w) for s, v, w in run["evals"] if v >= args.threshold), None)
        when = f"step {reached[0]} after {reached[1]:.0f} s" if reached else "not reached"
        line += f"\n{'':18}held-out {curve}; >= {args.threshold:.0%}: {when}; training {run['train_s']:.0f} s"
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="preset or checkpoint")
    p.add_argument("--runs", default="sync,k1", help="comma-separated: sync, k<K>[-recompute][-process]")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (8 completions each)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of steps/s")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: none)")
    p.add_argument("--eval-examples", type=int, default=1)
    p.add_argument("--threshold", type=float, default=0.5, help="held-out exact match whose first crossing is timed")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the default, one per core)")
    args = p.parse_args()
    names = args.runs.split(",")
    for name in names:
        run_options(name)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            runs[name] = timed_run(args, Path(tmp) / name, name)
            print(report(args, name, runs[name]), flush=True)
    print(f"{args.model}, {args.prompts} prompts × 8, {args.max_new_tokens} new tokens, {args.steps} steps:")
    for name, run in runs.items():
        print(report(args, name, run))
    if "sync" in runs:
        ratios = ", ".join(f"{n} {r['steps_s'] / runs['sync']['steps_s']:.2f}x" for n, r in runs.items() if n != "sync")
        print(f"  steps/s against sync: {ratios}")


if __name__ == "__main__":
    main()
