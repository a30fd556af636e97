"""Soak test of `spinwheel serve` (issue 12's acceptance): normal and hostile clients for minutes, in each
preemption mode, on a KV pool small enough that preemption really happens. Not part of the test suite.

For each mode in `--modes` the server runs as a subprocess for its share of `--minutes` while clients send normal
completions and chat (streaming or not, n > 1, beam search, prompt lists), disconnect mid-stream, leave streams unread,
hold half-sent headers (slowloris), send malformed JSON, bad fields, oversized bodies (sized and chunked) and non-ASCII
keys, and send poisoned but valid requests (extreme beam-search scores, huge echo + logprobs batches, 20,000 chat
messages), each of which must get its own 400 (or 200) and fail nobody else. Two thirds in, the engine process is
SIGKILLed once: 5xx answers and in-stream errors of requests overlapping its outage count as injected. RSS (API and
engine processes) and `/metrics` are sampled every `--sample-s`. It prints requests by status class and checks: no 5xx
or in-stream error but injected ones, no catch-all 500, no KV block in use once drained, preemptions, the engine back
after the kill, RSS slopes of the API and engine (until the kill) processes below `--max-rss-slope-mb-min` (a minute or
more per mode) over the second half of the samples: the first warms caches (oneDNN's of batch shapes,
`--engine-onednn-cache-capacity`). Exit 1 on failure.

    .venv/bin/python benchmarks/soak.py --minutes 6                 # 3 minutes per preemption mode
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

API_KEY = "soak-key"
AUTH = f"authorization: Bearer {API_KEY}\r\n".encode()
CLOSE_REASONS = ("header_timeout", "write_stall", "evicted", "refused")
PROMPTS = ["12+34=", "hello there", "The quick brown fox jumps over", "a" * 40, "7*8=", "once upon a time, "]


@dataclass
class Tally:
    """What the clients saw in one mode; ``outage`` is the engine's down time [kill, back] (monotonic)."""

    status: Counter = field(default_factory=Counter)  # "2xx" / "4xx" / "5xx" / "closed"
    unexpected: list[str] = field(default_factory=list)
    injected: int = 0
    outage: list[float] = field(default_factory=list)
    kill_s: list[float] = field(default_factory=list)  # from the kill until /health said 503, then 200
    poisoned: Counter = field(default_factory=Counter)  # "name: status" of the poison client's requests

    def record(self, kind: str, status: int | str, t0: float, error: str | None = None) -> None:
        """One request's answer; a 5xx, or a stream that ended in an error object, is injected when the request
        overlapped the engine's outage, unexpected otherwise."""
        self.status[status if isinstance(status, str) else f"{status // 100}xx"] += 1
        if error is None and not (isinstance(status, int) and status >= 500):
            return
        start, end = (self.outage + [math.inf, math.inf])[:2]
        if t0 <= end and time.monotonic() >= start:
            self.injected += 1
        else:
            self.unexpected.append(f"{kind}: {status} {error or ''}"[:200])


def _rss_mb(pid: int) -> float:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    except Exception:  # the process is gone (the engine, between kill and restart)
        return float("nan")


def _metrics(text: str) -> dict[str, float]:
    samples = (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, _, value in samples}


def _slope_mb_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS over time, MiB per minute, over the second half (the first one warms up)."""
    pts = [(t, r) for t, r in samples[len(samples) // 2 :] if r == r]
    if len(pts) < 3:
        return 0.0
    mt, mr = sum(t for t, _ in pts) / len(pts), sum(r for _, r in pts) / len(pts)
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 60 * sum((t - mt) * (r - mr) for t, r in pts) / var if var else 0.0


async def normal_client(url: str, model: str, tally: Tally, stop: float, rng: random.Random) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as client:
        while time.monotonic() < stop:
            chat = rng.random() < 0.35
            body: dict = {"model": model, "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0, 0.8])}
            prompt = rng.choice(PROMPTS) if chat or rng.random() < 0.8 else rng.sample(PROMPTS, 2)
            key, value = ("messages", [{"role": "user", "content": prompt}]) if chat else ("prompt", prompt)
            body[key] = value
            kind = rng.choice(["n", "beam", "stream", "plain", "leave"])  # leave: disconnect mid-stream
            if kind in ("n", "leave"):
                body["n"] = rng.randint(2, 3)
            elif kind == "beam":
                body.update(use_beam_search=True, n=2, best_of=3, temperature=0)
            body["stream"] = kind in ("stream", "leave") or (kind == "n" and rng.random() < 0.5)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            t0, error = time.monotonic(), None
            try:
                if body["stream"]:
                    lines = []
                    async with client.stream("POST", path, json=body) as r:
                        status = r.status_code
                        async for line in r.aiter_lines():
                            lines += [line] if line.startswith("data: ") else []
                            if kind == "leave" and rng.random() < 0.2:
                                break
                    if status != 200 or (kind != "leave" and (not lines or lines[-1] != "data: [DONE]")):
                        error = f"stream did not end with [DONE]: {lines[-1:]}"
                    error = error or next((x for x in lines if '"error"' in x[:40]), None)
                else:
                    r = await client.post(path, json=body)
                    status = r.status_code
                    want = body.get("n", 1) * (2 if isinstance(body.get("prompt"), list) else 1)
                    if status != 200 or len(r.json()["choices"]) != want:
                        error = r.text[:200]
            except httpx.HTTPError as e:
                status, error = "closed", repr(e)
            tally.record(f"{path} {kind}", status, t0, error)
            if error:  # as a client would: not a tight loop of 503s while the engine restarts
                await asyncio.sleep(0.2)


async def _raw(port: int, data: bytes, hold_s: float, read: bool = True) -> bytes | None:
    """Send bytes on a fresh connection and read the answer (None: none in ``hold_s``) while writing: a server
    that answers 413 before the body's end may reset the connection, dropping data not yet read. A small receive
    buffer, so that a stream left unread fills the server's buffers soon."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    answer = asyncio.ensure_future(asyncio.wait_for(reader.read(1 << 16) if read else asyncio.sleep(hold_s), hold_s))
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return (await answer) or b""
    except TimeoutError:
        return None
    except ConnectionError:
        return b""
    finally:
        writer.close()


def _post(path: str, body: bytes, extra: bytes = AUTH) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + extra + b"connection: close\r\n\r\n" + body


def hostile_requests(model: str) -> list[tuple[str, bytes]]:
    """Malformed requests, each answered 4xx by a healthy server (never 5xx)."""

    def body(**fields: object) -> bytes:
        return json.dumps({"model": model, **fields}).encode()

    big = body(prompt="x" * (2 << 20))
    chunks = [big[i : i + 65536] for i in range(0, len(big), 65536)] + [b""]
    chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n" + AUTH
    chunked += b"connection: close\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return [
        ("bad json", _post("/v1/completions", body(prompt="a")[:-9])),
        ("bad field", _post("/v1/completions", body(prompt="a", n=-1))),
        ("bad type", _post("/v1/chat/completions", body(messages="hi"))),
        ("surrogate", _post("/v1/completions", body(prompt="\ud800"))),
        ("min>max", _post("/v1/completions", body(prompt="a", min_tokens=9, max_tokens=2))),
        ("too long", _post("/v1/completions", body(prompt="a" * 500))),
        ("oversized", _post("/v1/completions", big)),
        ("chunked oversized", chunked),
        ("non-ascii key", _post("/v1/completions", body(prompt="a"), "authorization: Bearer cl\u00e9\r\n".encode())),
        ("no key", _post("/v1/completions", body(prompt="a"), b"")),
    ]


async def hostile_client(port: int, model: str, tally: Tally, stop: float, rng: random.Random) -> None:
    requests = hostile_requests(model)
    while time.monotonic() < stop:
        name, data = rng.choice(requests)
        t0 = time.monotonic()
        match = re.match(rb"HTTP/1\.1 (4\d\d)", await _raw(port, data, 10) or b"")
        tally.record(name, int(match.group(1)) if match else "closed", t0, None if match else "no 4xx answer")
        await asyncio.sleep(0.05)  # a steady trickle, not most of the server's work


def poisoned_requests(model: str) -> list[tuple[str, dict, int]]:
    """Valid JSON a client may send to hurt the others: (name, body, the status it must get). Extreme beam-search
    scores used to raise inside the engine and fail every request in flight; a 1,024-prompt echo with logprobs=20
    built a 131 MB response on the event loop; 20,000 chat messages stalled it in validation."""
    beam = {"model": model, "prompt": "hello", "max_tokens": 8, "n": 2, "use_beam_search": True, "temperature": 0}
    prompts = [("0123456789" * 10)[i % 10 :][:90] for i in range(1024)]
    return [
        ("beam length_penalty 700", beam | {"length_penalty": 700}, 400),
        ("beam length_penalty 1e308", beam | {"length_penalty": 1e308}, 400),
        ("beam length_penalty -inf", beam | {"length_penalty": -math.inf}, 400),
        ("beam length_penalty NaN", beam | {"length_penalty": math.nan}, 400),
        ("echo logprobs 1024 prompts", {"model": model, "prompt": prompts, "echo": True, "logprobs": 20}, 400),
        ("echo logprobs 32 prompts", {"model": model, "prompt": prompts[:32], "echo": True, "logprobs": 20}, 200),
        ("20k messages", {"model": model, "messages": [{"role": "user", "content": ""}] * 20_000}, 400),
    ]


async def poison_client(url: str, model: str, tally: Tally, stop: float, rng: random.Random) -> None:
    """Poisoned-but-valid requests among the normal ones: each must get its own answer (a 400, or a 200 for a big
    request under the limits) and leave the normal clients untouched."""
    requests = poisoned_requests(model)
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as client:
        while time.monotonic() < stop:
            name, body, want = rng.choice(requests)
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            t0, error = time.monotonic(), None
            try:  # json.dumps writes NaN and Infinity as Python's (and the server's) parser reads them
                r = await client.post(path, content=json.dumps(body | {"max_tokens": body.get("max_tokens", 1)}))
                status = r.status_code
                if status != want:
                    error = f"wanted {want}: {r.text[:150]}"
            except httpx.HTTPError as e:
                status, error = "closed", repr(e)
            tally.poisoned[f"{name}: {status}"] += 1
            tally.record(f"poisoned {name}", status, t0, error)
            await asyncio.sleep(0.2)


async def stalling_client(port: int, model: str, tally: Tally, stop: float, rng: random.Random) -> None:
    """Slowloris connections (half a request head: the server must close them after its 2 s header timeout) and
    streams that are never read (their outputs coalesce while the client does not read: no leaked blocks)."""
    while time.monotonic() < stop:
        if rng.random() < 0.5:
            t0, head = time.monotonic(), b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: "
            for reply in await asyncio.gather(*[_raw(port, head, 8) for _ in range(20)]):
                kept = reply is None
                tally.record("slowloris", "open" if kept else "closed", t0, "kept open" if kept else None)
        else:
            body = {"model": model, "prompt": "a", "n": 3, "max_tokens": 100, "logprobs": 5, "ignore_eos": True}
            await _raw(port, _post("/v1/completions", json.dumps({**body, "stream": True}).encode()), 8, read=False)
            tally.status["unread stream"] += 1


async def sampler(url: str, pids: list[int], every_s: float, rss: list, metrics: list) -> None:
    """RSS of the API and engine processes, and /metrics, every ``every_s`` until cancelled."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while True:
            rss.append((time.monotonic(), _rss_mb(pids[0]), _rss_mb(pids[1])))
            with contextlib.suppress(httpx.HTTPError):
                metrics.append(_metrics((await client.get("/metrics")).text))
            await asyncio.sleep(every_s)


async def kill_engine(url: str, pids: list[int], at: float, tally: Tally, metrics: list, log_path: str) -> None:
    """SIGKILL the engine process once at ``at`` (its counters sampled first: they restart from 0); the outage
    lasts until /health, having answered 503, answers 200 again."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        metrics.append(_metrics((await client.get("/metrics")).text))
        tally.outage.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)
        for up in (False, True):
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if ((await client.get("/health")).status_code == 200) == up:
                        break
                await asyncio.sleep(0.05)
            tally.kill_s.append(time.monotonic() - tally.outage[0])
    tally.outage.append(time.monotonic() + 1.0)  # answers already on their way count as injected too
    with open(log_path) as f:
        pids[1] = int(re.findall(r"engine process (?:is back \()?pid (\d+)", f.read())[-1])


def start_server(args: argparse.Namespace, mode: str, log) -> tuple[subprocess.Popen, str, int, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "spinwheel.cli", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--engine-preemption-mode", mode, "--engine-num-kv-blocks", str(args.num_kv_blocks)]
    cmd += ["--engine-num-cpu-blocks", str(args.num_kv_blocks), "--engine-block-size", "8"]
    cmd += ["--header-timeout-s", "2", "--stall-timeout-s", "2", "--max-connections", "256", "--log-level", "warning"]
    cmd += ["--send-buffer-kb", "4", "--api-key", API_KEY]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"soak: the server did not start; see {log.name}")
        time.sleep(0.2)
    with open(log.name) as f:
        engine_pid = int(re.search(r"engine process pid (\d+)", f.read()).group(1))
    return proc, url, port, engine_pid


async def soak_mode(args: argparse.Namespace, mode: str, seconds: float) -> bool:
    with tempfile.NamedTemporaryFile("w", prefix=f"soak-{mode}-", suffix=".log", delete=False) as log:
        proc, url, port, engine_pid = start_server(args, mode, log)
    model = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
    tally, rss, metrics, pids = Tally(), [], [], [proc.pid, engine_pid]
    rng, start, stop = random.Random(args.seed), time.monotonic(), time.monotonic() + seconds
    tasks = [normal_client(url, model, tally, stop, random.Random(rng.random())) for _ in range(args.clients)]
    tasks += [hostile_client(port, model, tally, stop, random.Random(rng.random())) for _ in range(2)]
    tasks += [stalling_client(port, model, tally, stop, random.Random(rng.random()))]
    tasks += [poison_client(url, model, tally, stop, random.Random(rng.random()))]
    if args.kill:
        tasks += [kill_engine(url, pids, start + seconds * 2 / 3, tally, metrics, log.name)]
    sampling = asyncio.ensure_future(sampler(url, pids, args.sample_s, rss, metrics))
    await asyncio.gather(*tasks)
    drained, deadline = {}, time.monotonic() + 30  # stalled streams hold blocks until their stall timeout
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while time.monotonic() < deadline:
            drained = _metrics((await client.get("/metrics")).text)
            busy = sum(drained[f"spinwheel_num_requests_{s}"] for s in ("running", "waiting", "swapped"))
            if not busy and drained["spinwheel_num_free_kv_blocks"] == drained["spinwheel_num_kv_blocks"]:
                break
            await asyncio.sleep(0.5)
    sampling.cancel()
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    return report(args, mode, seconds, tally, rss, metrics, drained, log.name)


def report(args, mode, seconds, tally: Tally, rss, metrics, drained, log_path) -> bool:
    preemptions, last = 0.0, 0.0  # a restarted engine counts from 0 again
    for m in metrics + [drained]:
        value = m.get("spinwheel_num_preemptions_total", 0.0)
        preemptions += value - last if value >= last else value
        last = value
    leaked = drained["spinwheel_num_kv_blocks"] - drained["spinwheel_num_free_kv_blocks"]
    api = [(t, a) for t, a, _ in rss]
    engine = [(t, e) for t, _, e in rss if e == e and t < (tally.outage + [math.inf])[0]] or [(0.0, math.nan)]
    slope, engine_slope = _slope_mb_min(api), _slope_mb_min(engine)
    server_500 = drained.get('spinwheel_http_errors_total{status="500"}', 0.0)
    print(f"--- soak, preemption mode {mode}: {seconds:.0f} s, log {log_path}")
    print(f"requests by status: {dict(sorted(tally.status.items()))}; injected faults: {tally.injected}", end="")
    print(f" (engine killed: /health 503 / 200 after {' / '.join(f'{s:.2f}' for s in tally.kill_s)} s)")
    print(f"poisoned requests: {dict(sorted(tally.poisoned.items()))}")
    normal = [u for u in tally.unexpected if not u.startswith("poisoned ")]
    print(f"unexpected failures: {len(tally.unexpected)} ({len(normal)} of normal clients); ", end="")
    print(f"catch-all 500s: {server_500:.0f}")
    print("".join(f"  {line}\n" for line in tally.unexpected[:5]), end="")
    print(f"KV blocks in use after draining: {leaked:.0f} of {drained['spinwheel_num_kv_blocks']:.0f}; ", end="")
    print(f"preemptions: {preemptions:.0f}")
    closed = {r: drained.get(f'spinwheel_connections_closed_total{{reason="{r}"}}', 0) for r in CLOSE_REASONS}
    print("connections closed by the server: " + ", ".join(f"{r} {n:.0f}" for r, n in closed.items()))
    print(
        f"API RSS MiB first/last/max {api[0][1]:.0f}/{api[-1][1]:.0f}/{max(r for _, r in api):.0f}, "
        f"slope {slope:+.1f} MiB/min; engine RSS (until the kill) first/last/max "
        f"{engine[0][1]:.0f}/{engine[-1][1]:.0f}/{max(e for _, e in engine):.0f}, slope {engine_slope:+.1f}"
    )
    for name, series in (("API", api), ("engine", engine)):  # a plateau after warming up, or a climb?
        tenths = [series[min(len(series) - 1, i * len(series) // 10)][1] for i in range(10)] + [series[-1][1]]
        print(f"{name} RSS MiB at each tenth of the run: {' '.join(f'{x:.0f}' for x in tenths)}")
    checks = {
        "no unexpected 5xx or stream errors": not tally.unexpected and not server_500,
        "no KV blocks in use after draining": leaked == 0,
        f"preemptions >= {args.min_preemptions}": preemptions >= args.min_preemptions,
        "the engine came back after the kill": not args.kill or len(tally.outage) == 2,
        "slowloris closed after the header timeout": not tally.status["closed"] or closed["header_timeout"] > 0,
    }
    if seconds >= 60:
        limit = args.max_rss_slope_mb_min
        checks[f"RSS slopes (API, engine) below {limit} MiB/min"] = max(slope, engine_slope) < limit
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return all(checks.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=6.0, help="total, split evenly across the modes")
    p.add_argument("--modes", default="recompute,swap")
    p.add_argument("--model", default="test")
    p.add_argument("--clients", type=int, default=8, help="concurrent normal clients")
    p.add_argument("--num-kv-blocks", type=int, default=48)
    p.add_argument("--min-preemptions", type=int, default=1)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--max-rss-slope-mb-min", type=float, default=5.0)
    p.add_argument("--no-kill", dest="kill", action="store_false", help="do not SIGKILL the engine process")
    p.add_argument("--seed", type=int, default=0)
    args, modes = p.parse_args(), p.parse_args().modes.split(",")
    results = [asyncio.run(soak_mode(args, mode, 60 * args.minutes / len(modes))) for mode in modes]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
