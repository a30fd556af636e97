"""Four Tinker clients on one ``spinwheel tinker`` service vs four services, one client each.

Each client runs ``--steps`` of forward_backward (``--batch`` copies of a ``--tokens``-token datum, cross_entropy) +
optim_step through the official ``tinker`` SDK. "shared": one process holds the base once and serves all four clients
(their forward_backward calls batched together); "separate": four processes, each its own copy of the base and one
client. Printed: total steps/s and peak RSS (VmHWM, summed over the processes), side by side, and their ratios.
"shared, gather 50 ms" is the shared service with ``--gather-ms 50`` (a forward_backward batch waits up to 50 ms for
clients between two steps, to run more of them together). "CPU s/step" is the CPU time (user + system, all threads,
SDK clients included) per training step: the cost, whatever share of a busy machine a run gets. The modes run in
turn, ``--rounds`` times (interleaved, so that the load of a shared machine falls on all of them alike); each mode's
best round counts.

    python benchmarks/tinker.py --model tiny
    python benchmarks/tinker.py --model smollm2-135m-instruct --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

# This file's name is the SDK's: keep its folder off the import path so `import tinker` finds the SDK.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds() -> float:
    """CPU time (user + system, every thread) this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(model: str, clients: int, steps: int, batch: int, tokens: int, gather_ms: float) -> dict:
    """One service with ``clients`` SDK clients training concurrently; returns steps, seconds and peak RSS."""
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    import numpy as np
    import tinker
    from tinker import types

    from spinwheel.tinker.serve import BackgroundTinker, TinkerConfig, build_service

    run_dir = tempfile.mkdtemp(prefix="tinker-bench-")
    svc = build_service(TinkerConfig(model=model, run_dir=run_dir, gather_ms=gather_ms))
    with BackgroundTinker(svc) as bg:
        sdk = tinker.ServiceClient(base_url=bg.url)
        tcs = [sdk.create_lora_training_client(base_model=model, rank=8, seed=i).result() for i in range(clients)]
        vocab = svc.model.config.vocab_size
        rng = np.random.default_rng(0)

        def train(tc) -> None:
            ids = rng.integers(4, min(vocab, 1000), tokens + 1)
            d = types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                loss_fn_inputs={"target_tokens": ids[1:].astype(np.int64), "weights": np.ones(tokens, np.float32)},
            )
            for _ in range(steps):
                fb = tc.forward_backward([d] * batch, "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                fb.result()

        train(tcs[0])  # warm-up (one client's steps, not timed)
        cpu0, start = cpu_seconds(), time.perf_counter()
        threads = [threading.Thread(target=train, args=(tc,)) for tc in tcs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
        batches = svc.worker.batch_sizes[steps:]
        optims = svc.worker.optim_batch_sizes[steps:]
    return {
        "steps": clients * steps,
        "seconds": seconds,
        "cpu_s": cpu,
        "rss_mb": peak_rss_mb(),
        "mean_batch": sum(batches) / max(1, len(batches)),
        "mean_optim_batch": sum(optims) / max(1, len(optims)),
    }


def launch(args: argparse.Namespace, clients: int, gather_ms: float = 0.0) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--worker", str(clients), "--model", args.model, "--steps", str(args.steps)]
    argv += ["--batch", str(args.batch), "--tokens", str(args.tokens), "--gather-ms", str(gather_ms)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def collect(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a benchmark worker failed (exit {p.returncode})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="times each mode runs, in turn (its best counts)")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--gather-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out = worker(args.model, args.worker, args.steps, args.batch, args.tokens, args.gather_ms)
        print(json.dumps(out), flush=True)
        return
    print(
        f"model {args.model}, {args.clients} clients x {args.steps} steps of {args.batch} x {args.tokens} tokens, "
        f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}, load {loadavg()} at the start"
    )
    best: dict[str, tuple[float, float, str]] = {}
    for _ in range(args.rounds):
        for mode in ("shared", "shared, gather 50 ms", "separate processes"):
            if mode == "separate processes":
                runs = collect([launch(args, 1) for _ in range(args.clients)])
                rate = sum(r["steps"] for r in runs) / max(r["seconds"] for r in runs)
                rss, note = sum(r["rss_mb"] for r in runs), ""
                cpu = sum(r["cpu_s"] for r in runs) / sum(r["steps"] for r in runs)
            else:
                (r,) = collect([launch(args, args.clients, 0.0 if mode == "shared" else 50.0)])
                rate, rss, cpu = r["steps"] / r["seconds"], r["rss_mb"], r["cpu_s"] / r["steps"]
                note = f"(mean batch: forward_backward {r['mean_batch']:.2f}, optim_step {r['mean_optim_batch']:.2f})"
            print(f"  round: {mode:20} {rate:6.2f} steps/s {cpu:6.3f} CPU s/step {note}", flush=True)
            if mode not in best or rate > best[mode][0]:
                best[mode] = (rate, rss, cpu, note)
    print(f"load {loadavg()} at the end; best round of each mode:")
    print(f"{'':24}{'steps/s':>10}{'peak RSS MB':>14}{'CPU s/step':>12}")
    for mode, (rate, rss, cpu, note) in best.items():
        print(f"{mode:24}{rate:10.2f}{rss:14.0f}{cpu:12.3f}   {note}")
    shared, sep = best["shared"], best["separate processes"]
    print(
        f"ratio shared / separate: steps/s {shared[0] / sep[0]:.2f}x, peak RSS {shared[1] / sep[1]:.2f}x, "
        f"CPU s/step {shared[2] / sep[2]:.2f}x"
    )


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    main()
