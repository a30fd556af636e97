"""Load test of `spinwheel serve`: N concurrent streaming clients on loopback.

Starts the server as a subprocess (so clients and server do not share a GIL), sends `--requests` streaming
completions from `--clients` concurrent asyncio clients, and reports request throughput, output tokens/s, time to
first token and inter-token latency (p50 / p99). It does so for each engine mode in `--modes`, back to back in one
run: `process` (the engine in its own process, serve's default) and `thread` (`--no-engine-process`). For reference
it runs the same workload through the offline `LLM.generate` in this process before and after the servers, and
prints each server's throughput as a ratio of the offline mean, with the machine's load average, since a loaded
machine moves every figure. Offline takes all requests at once; the server holds at most one per client, so a
second offline figure caps the batch at `--clients` sequences (`max_num_seqs`): its ratio is the cost of HTTP and
streaming alone.

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
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
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


def _body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _is_token_event(data: bytes | str) -> bool:
    payload = json.loads(data)
    return bool(payload["choices"] and payload["choices"][0]["text"])


async def _httpx_client(url: str, model: str, queue: asyncio.Queue, results: list, http: httpx.AsyncClient) -> None:
    while True:
        try:
            prompt, max_tokens = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        t0 = time.perf_counter()
        stamps: list[float] = []
        async with http.stream(
            "POST", url + "/v1/completions", json=_body(model, prompt, max_tokens) | {"stream": True}
        ) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and _is_token_event(line[6:]):
                    stamps.append(time.perf_counter())
        results.append((t0, stamps, max_tokens))


async def _raw_client(url: str, model: str, queue: asyncio.Queue, results: list) -> None:
    """A lean HTTP/1.1 client on one keep-alive connection (chunked SSE responses parsed by hand): on a machine with
    few cores, httpx's per-event cost would take CPU from the server it measures."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        while True:
            try:
                prompt, max_tokens = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = json.dumps(_body(model, prompt, max_tokens) | {"stream": True}).encode()
            t0 = time.perf_counter()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (host.encode(), len(body), body)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in head.lower():
                raise RuntimeError(f"unexpected response head: {head[:200]!r}")
            stamps: list[float] = []
            pending = b""
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                chunk = (await reader.readexactly(size + 2))[:-2]
                if size == 0:
                    break
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    if event.startswith(b"data: {") and _is_token_event(event[6:]):
                        stamps.append(time.perf_counter())
            results.append((t0, stamps, max_tokens))
    finally:
        writer.close()


async def _run_load(url: str, model: str, work: list[tuple[str, int]], clients: int, client: str = "raw") -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for w in work:
        queue.put_nowait(w)
    results: list = []
    t0 = time.perf_counter()
    if client == "raw":
        await asyncio.gather(*[_raw_client(url, model, queue, results) for _ in range(clients)])
    else:
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            await asyncio.gather(*[_httpx_client(url, model, queue, results, http) for _ in range(clients)])
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


OFFLINE_CPU: list[float] = []  # output tokens per CPU second of each all-at-once offline run


def _offline(args: argparse.Namespace, work: list[tuple[str, int]], max_num_seqs: int = 256) -> float:
    """Output tokens/s of ``LLM.generate`` on the whole workload at once (after a warm-up generation), with at most
    ``max_num_seqs`` sequences per step."""
    import torch

    from spinwheel.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_num_seqs=max_num_seqs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate([p for p, _ in work[:8]], params[:8])  # warm-up: first-call costs are not throughput
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in work], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    OFFLINE_CPU.append(tokens / cpu)
    return tokens / wall


def _serve(args: argparse.Namespace, work: list[tuple[str, int]], mode: str) -> tuple[dict, str]:
    """Start `spinwheel serve` in ``mode``, run the load, return the client-side figures and /metrics."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "spinwheel.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--log-level", "warning"]
    cmd += ["--engine-process" if mode == "process" else "--no-engine-process"]
    cmd += shlex.split(args.process_args if mode == "process" else args.thread_args)
    log = tempfile.TemporaryFile()  # the server's start-up lines (the warm-up's decode-step fit), read after
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
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
        asyncio.run(_run_load(url, "bench", work[:8], min(8, args.clients), args.client))  # warm-up
        kids = _children(proc.pid)  # the engine process (and multiprocessing's resource tracker) in process mode
        before = {"api": _cpu_seconds(proc.pid), **({"engine": sum(map(_cpu_seconds, kids))} if kids else {})}
        client0 = time.process_time()
        stats = asyncio.run(_run_load(url, "bench", work, args.clients, args.client))
        after = {"api": _cpu_seconds(proc.pid), "engine": sum(map(_cpu_seconds, kids))}
        cpu = {k: after[k] - v for k, v in before.items()} | {"client": time.process_time() - client0}
        stats |= {f"cpu_{k}_cores": v / stats["wall_s"] for k, v in cpu.items()}
        return stats, httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
        log.seek(0)
        fit = [line for line in log.read().decode(errors="replace").splitlines() if "warm-up step" in line]
        if fit:
            print(f"  {mode}: {fit[0].removeprefix('spinwheel serve: ')}")
        log.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; 0 when it is gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (the engine process of `serve --engine-process`)."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


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
    ap.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="load generator: a lean asyncio HTTP client (raw) or httpx (heavier per event; the figures before "
        "the engine process were measured with it)",
    )
    ap.add_argument("--process-args", default="", help="more `spinwheel serve` options for the process mode")
    ap.add_argument(
        "--thread-args",
        default="",
        help="more `spinwheel serve` options for the thread mode (e.g. the settings of an earlier version, "
        "to compare with it: --engine-max-num-batched-tokens-with-decodes 2048)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="runs of each mode (alternating); medians reported")
    args = ap.parse_args()
    work = _workload(args)
    print(
        f"workload: model={args.model} clients={args.clients} requests={args.requests} prompt chars "
        f"{args.min_prompt}-{args.max_prompt} output tokens {args.min_tokens}-{args.max_tokens} (ignore_eos, "
        f"greedy) threads={args.threads}; client={args.client}; {os.cpu_count()} CPUs"
    )
    print(f"start: {_load()}")
    offline: list[float] = []
    capped: list[float] = []
    runs: dict[str, list[tuple[dict, str]]] = {mode: [] for mode in args.modes}
    for r in range(args.repeats):
        offline.append(_offline(args, work))
        capped.append(_offline(args, work, args.clients))
        for mode in args.modes if r % 2 == 0 else args.modes[::-1]:  # alternate, so that drift hits both alike
            runs[mode].append(_serve(args, work, mode))
            print(f"run {r + 1} {mode}: {runs[mode][-1][0]['output_tokens_per_s']:.0f} output tok/s; {_load()}")
    offline.append(_offline(args, work))
    capped.append(_offline(args, work, args.clients))
    offline_tps, capped_tps = statistics.median(offline), statistics.median(capped)
    print(
        f"offline LLM.generate, same workload: median {offline_tps:.0f} output tok/s (runs: "
        f"{', '.join(f'{x:.0f}' for x in offline)}); with at most {args.clients} sequences per step (the "
        f"server's concurrency): {capped_tps:.0f} ({', '.join(f'{x:.0f}' for x in capped)})"
    )
    results = {mode: sorted(rs, key=lambda r: r[0]["output_tokens_per_s"])[len(rs) // 2] for mode, rs in runs.items()}
    if args.repeats > 1:
        print(f"server figures: the median run of {args.repeats} per mode")
    for mode, (stats, metrics) in results.items():
        preempt = [line for line in metrics.splitlines() if line.startswith("spinwheel_num_preemptions_total")]
        print(
            f"server engine={mode:7s}: {stats['requests_per_s']:.2f} req/s, {stats['output_tokens_per_s']:.0f} "
            f"output tok/s = {stats['output_tokens_per_s'] / offline_tps:.2f}x offline "
            f"({stats['output_tokens_per_s'] / capped_tps:.2f}x at the same concurrency); TTFT p50 "
            f"{stats['ttft_p50_ms']:.0f} ms p99 {stats['ttft_p99_ms']:.0f} ms, ITL p50 {stats['itl_p50_ms']:.1f} ms "
            f"p99 {stats['itl_p99_ms']:.1f} ms ({stats['wall_s']:.1f} s; {'; '.join(preempt)})"
        )
        cores = ", ".join(f"{k[4:-6]} {v:.2f}" for k, v in stats.items() if k.startswith("cpu_"))
        print(f"  CPU cores busy during the run: {cores} (of {os.cpu_count()})")
        if args.repeats > 1:  # a p99 of one run is a few requests: the median of each latency over the runs
            keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
            each = {k: [r[0][k] for r in runs[mode]] for k in keys}
            print(
                "  latency, median over the runs (each run): "
                + "; ".join(
                    f"{k[:-3].replace('_', ' ')} {statistics.median(v):.1f} ms ({', '.join(f'{x:.0f}' for x in v)})"
                    for k, v in each.items()
                )
            )
    if OFFLINE_CPU:
        print(f"offline: {statistics.median(OFFLINE_CPU):.0f} output tokens per CPU second (median)")
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
