"""Load test of `spinwheel serve`: N concurrent streaming clients on loopback.

Starts the server as a subprocess (so clients and server do not share a GIL), sends `--requests` streaming
completions from `--clients` concurrent asyncio clients, and reports request throughput, output tokens/s, time to
first token and inter-token latency (p50 / p99). It does so for each engine mode in `--modes`, back to back in one
run: `process` (the engine in its own process, serve's default) and `thread` (`--no-engine-process`). For reference
it runs the same workload through the offline `LLM.generate` in this process before and after the servers, and
prints each server's throughput as a ratio of the offline mean (the cost of HTTP + streaming), with the machine's
load average, since a loaded machine moves every figure.

    .venv/bin/python benchmarks/server_load.py                      # tiny preset, 32 clients, 128 requests
    .venv/bin/python benchmarks/server_load.py --model small --modes process
    .venv/bin/python benchmarks/server_load.py --model runs/demo/checkpoint --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _workload(args: argparse.Namespace) -> list[tuple[str, int]]:
    rng = random.Random(args.seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789+-*= "
    return [
        (
            "".join(rng.choice(alphabet) for _ in range(rng.randint(args.min_prompt, args.max_prompt))),
            rng.randint(args.min_tokens, args.max_tokens),
        )
        for _ in range(args.requests)
    ]


async def _client(url: str, model: str, queue: asyncio.Queue, results: list, http: httpx.AsyncClient) -> None:
    while True:
        try:
            prompt, max_tokens = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        stamps: list[float] = []
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload["choices"] and payload["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
        results.append((t0, stamps, max_tokens))


async def _run_load(url: str, model: str, work: list[tuple[str, int]], clients: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for w in work:
        queue.put_nowait(w)
    results: list = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[_client(url, model, queue, results, http) for _ in range(clients)])
        wall = time.perf_counter() - t0
    ttft = [s[0] - t for t, s, _ in results if s]
    itl = [b - a for _, s, _ in results for a, b in zip(s, s[1:])]
    tokens = sum(n for _, _, n in results)
    return {
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * _pct(ttft, 0.5),
        "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
        "itl_p50_ms": 1e3 * _pct(itl, 0.5),
        "itl_p99_ms": 1e3 * _pct(itl, 0.99),
        "tokens": tokens,
    }


def _offline(args: argparse.Namespace, work: list[tuple[str, int]]) -> float:
    import torch

    from spinwheel.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def _serve(args: argparse.Namespace, work: list[tuple[str, int]], mode: str) -> tuple[dict, str]:
    """Start `spinwheel serve` in ``mode``, run the load, return the client-side figures and /metrics."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "spinwheel.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--log-level", "warning"]
    cmd += ["--engine-process" if mode == "process" else "--no-engine-process"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server ({mode}) did not start")
            time.sleep(0.2)
        stats = asyncio.run(_run_load(url, "bench", work, args.clients))
        return stats, httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="checkpoint directory or preset")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server and of the offline run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--modes", nargs="+", choices=["process", "thread"], default=["process", "thread"], help="engine modes to run"
    )
    args = ap.parse_args()
    work = _workload(args)
    print(
        f"workload: model={args.model} clients={args.clients} requests={args.requests} prompt chars "
        f"{args.min_prompt}-{args.max_prompt} output tokens {args.min_tokens}-{args.max_tokens} (ignore_eos, "
        f"greedy) threads={args.threads}; {os.cpu_count()} CPUs"
    )
    print(f"start: {_load()}")
    offline = [_offline(args, work)]
    results = {}
    for mode in args.modes:
        results[mode] = _serve(args, work, mode)
        print(f"after {mode}: {_load()}")
    offline.append(_offline(args, work))
    offline_tps = sum(offline) / len(offline)
    runs = ", ".join(f"{x:.0f}" for x in offline)
    print(f"offline LLM.generate, same workload: {offline_tps:.0f} output tok/s (runs: {runs})")
    for mode, (stats, metrics) in results.items():
        preempt = [line for line in metrics.splitlines() if line.startswith("spinwheel_num_preemptions_total")]
        print(
            f"server engine={mode:7s}: {stats['requests_per_s']:.2f} req/s, {stats['output_tokens_per_s']:.0f} "
            f"output tok/s = {stats['output_tokens_per_s'] / offline_tps:.2f}x offline; TTFT p50 "
            f"{stats['ttft_p50_ms']:.0f} ms p99 {stats['ttft_p99_ms']:.0f} ms, ITL p50 {stats['itl_p50_ms']:.1f} ms "
            f"p99 {stats['itl_p99_ms']:.1f} ms ({stats['wall_s']:.1f} s; {'; '.join(preempt)})"
        )
    print(
        json.dumps(
            {
                m: {k: round(v, 3) if isinstance(v, float) else v for k, v in st.items()}
                for m, (st, _) in results.items()
            }
        )
    )


if __name__ == "__main__":
    main()
