"""Speed on a busy machine: each workload quiet and next to a busy loop, with spinwheel's default thread settings.

Three workloads, each in a fresh process (thread settings act when the OpenMP runtime starts):

* ``gen``  — engine generation on the ``small`` preset (random weights): 3 batches of 32 prompts of 24 tokens, 64
  new tokens each, greedy; output tokens/s;
* ``sft``  — ``train_sft`` on the ``tiny`` preset (the demo's SFT: batch 128 of the arithmetic task), 24 steps;
  completion tokens/s of the steps;
* ``grpo`` — ``train_rl`` GRPO on the ``tiny`` preset (the demo's step: 64 prompts × 8 samples), 6 steps; steps
  per second (the median step time).

Each worker builds its workload once, warms it up, then alternates ``--rounds`` times: a quiet measurement, then
the same measurement next to a busy loop (a spawned ``python -c "while True: pass"``, one core), which is stopped
again. The ratio is contended / quiet throughput of each round; the median over rounds is printed, with the load
average seen. ``--modes default old`` also runs the old behaviour (torch's thread defaults: ``SPINWHEEL_THREADS=off``)
for comparison; ``--modes env:OMP_WAIT_POLICY=passive`` or ``threads:1`` try other settings.

    python benchmarks/contention.py                       # default settings, all three workloads (~1-2 min)
    python benchmarks/contention.py --modes default old   # and the old behaviour (slow next to the busy loop)
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("gen", "sft", "grpo")
OMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "SPINWHEEL_THREADS")


def busy_loop() -> subprocess.Popen:
    """A process spinning on one core until killed; with ``CONTENTION_BUSY_SESSION=new`` in a session of its own
    (as a job started from another terminal: on Linux another autogroup, scheduled as a group against ours)."""
    new = os.environ.get("CONTENTION_BUSY_SESSION") == "new"
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=new)


def scratch_dir(name: str) -> str:
    """A temporary directory for the runs' outputs, removed when the worker exits."""
    path = tempfile.mkdtemp(prefix=f"contention-{name}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def gen_workload():
    import random

    from spinwheel.engine import LLM, SamplingParams

    llm = LLM("small", seed=0)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate([[5] * 24] * 4, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    def measure() -> float:
        t, tokens = time.perf_counter(), 0
        for _ in range(3):
            prompts = [[rng.randrange(3, 90) for _ in range(24)] for _ in range(32)]  # no prefix-cache hits
            tokens += sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params))
        return tokens / (time.perf_counter() - t)

    return measure, "output tokens/s"


def sft_workload(steps: int = 24):
    from spinwheel.train.sft.sft import train_sft
    from spinwheel.train.sft.sft_config import SFTConfig

    tmp = scratch_dir("sft")
    runs = iter(range(10**6))

    def measure() -> float:
        config = SFTConfig(
            model="tiny",
            out_dir=os.path.join(tmp, str(next(runs))),
            steps=steps,
            eval_every=0,
            eval_examples=1,
            save_every=0,
            resume=False,
            progress=False,
        )
        return float(train_sft(config)["history"][-1]["completion_tokens_per_s"])

    return measure, "completion tokens/s"


def grpo_workload(steps: int = 6):
    from spinwheel.rl.llm import RLConfig, train_rl

    tmp = scratch_dir("grpo")
    runs = iter(range(10**6))

    def measure() -> float:
        config = RLConfig(
            algo="grpo",
            model="tiny",
            out_dir=os.path.join(tmp, str(next(runs))),
            steps=steps,
            prompts_per_step=64,
            eval_every=0,
            eval_examples=1,
            save_every=0,
            resume=False,
            progress=False,
        )
        history = train_rl(config)["history"]
        times = [sum(v for k, v in r.items() if k.startswith("time/")) for r in history]
        return 1.0 / statistics.median(times)

    return measure, "steps/s"


def others_cpus(measure) -> tuple[float, float]:
    """Run ``measure()``; returns its result and the CPUs other processes used meanwhile (0 where not Linux)."""
    from spinwheel import threads

    def sample() -> tuple[float, float]:
        return (threads.busy_cpu_seconds() if threads.enabled() else 0.0), time.process_time()

    t0, (busy0, own0) = time.monotonic(), sample()
    result = measure()
    t1, (busy1, own1) = time.monotonic(), sample()
    return result, max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)


def worker(name: str, rounds: int) -> None:
    """Build the workload, warm it up, then ``rounds`` × (quiet, busy); one JSON line on stdout."""
    import torch

    from spinwheel import threads

    settle = threads.PROBE_S + threads.INTERVAL_S if threads.enabled() else 0.5
    measure, unit = {"gen": gen_workload, "sft": sft_workload, "grpo": grpo_workload}[name]()
    measure()  # warm-up
    out: dict = {"unit": unit, "quiet": [], "busy": [], "others_quiet": [], "threads_quiet": [], "threads_busy": []}
    for _ in range(rounds):
        result, others = others_cpus(measure)
        out["quiet"].append(result)
        out["others_quiet"].append(others)
        out["threads_quiet"].append(torch.get_num_threads())  # the count in force at the end
        proc = busy_loop()
        time.sleep(0.2)
        try:
            out["busy"].append(measure())
            out["threads_busy"].append(torch.get_num_threads())
        finally:
            proc.kill()
            proc.wait()
        time.sleep(settle)  # spinwheel goes back up to more threads PROBE_S after it last went down
    out["env"] = {k: os.environ[k] for k in OMP_VARIABLES if k in os.environ}
    print(json.dumps(out), flush=True)


def mode_env(mode: str) -> dict[str, str]:
    """The environment of a worker in ``mode``: default, old, threads:N or env:K=V[,K=V]."""
    if mode == "default":
        return {}
    if mode == "old":
        return {"SPINWHEEL_THREADS": "off"}
    if mode.startswith("threads:"):
        return {"OMP_NUM_THREADS": mode.split(":", 1)[1]}
    if mode.startswith("env:"):
        return dict(kv.split("=", 1) for kv in mode[4:].split(","))
    raise ValueError(f"unknown mode {mode!r}")


def run_worker(name: str, mode: str, rounds: int) -> dict:
    env = {**os.environ, **mode_env(mode)}
    for key in OMP_VARIABLES:  # a mode sets these explicitly or not at all
        if key not in mode_env(mode):
            env.pop(key, None)
    load = os.getloadavg()[0]
    out = subprocess.run(
        [sys.executable, __file__, "--worker", name, "--rounds", str(rounds)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"worker {name} ({mode}) failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["load"] = (load, os.getloadavg()[0])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--modes", nargs="+", default=["default"], help="default, old, threads:N, env:K=V[,K=V]")
    ap.add_argument("--rounds", type=int, default=3, help="quiet/busy pairs per worker (the median ratio is kept)")
    ap.add_argument("--busy-session", choices=("same", "new"), default="same", help="the busy loop's session")
    ap.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ["CONTENTION_BUSY_SESSION"] = args.busy_session
    if args.worker:
        return worker(args.worker, args.rounds)
    print(
        f"contention benchmark: {os.cpu_count()} CPUs; each workload in a fresh process, {args.rounds} rounds of "
        f"(quiet, next to one busy-loop process in the {args.busy_session} session); ratio = contended / quiet "
        "throughput, median over rounds"
    )
    for name in args.workloads:
        for mode in args.modes:
            report(name, mode, run_worker(name, mode, args.rounds))


def report(name: str, mode: str, r: dict) -> None:
    ratios = [b / q for q, b in zip(r["quiet"], r["busy"])]
    settings = ", ".join(f"{k}={v}" for k, v in r["env"].items()) or "no thread variables"
    threads = f"threads quiet {'/'.join(map(str, r['threads_quiet']))}, busy {'/'.join(map(str, r['threads_busy']))}"
    print(
        f"{name:4s} {mode:8s} ({settings}; {threads}): quiet {statistics.median(r['quiet']):.4g} {r['unit']}, "
        f"busy {statistics.median(r['busy']):.4g}; ratio {statistics.median(ratios):.2f} (rounds "
        f"{' '.join(f'{x:.2f}' for x in ratios)}); other processes' CPUs while quiet "
        f"{' '.join(f'{x:.2f}' for x in r['others_quiet'])}; load {r['load'][0]:.1f} -> {r['load'][1]:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
