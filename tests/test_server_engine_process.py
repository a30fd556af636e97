"""The engine in its own process (issue 12 item 13; what crosses the pipe: test_engine_process_outputs): the
server's end-to-end tests pass against it (those of test_server, test_server_fields and test_server_streaming marked
BOTH_ENGINE_MODES run against the same engine-process server as these);
aborts (disconnects, stalled readers) free the blocks in the engine process; an engine process killed mid-stream
fails its requests with error objects, answers 503 on /health, and is restarted, or the server exits with the
reason; never a hang."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from helpers import MODEL, PROMPTS, engine_spec, eventually, long_context_model, metric, wait_engine_idle

import spinwheel
from spinwheel.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from spinwheel.server import BackgroundServer, OpenAIServer, ServeConfig, build_server
from spinwheel.server.async_engine import AsyncEngine
from spinwheel.server.engine_client import EngineProcess
from spinwheel.server.engine_process import EngineSpec
from spinwheel.server.limits import ServerLimits


@pytest.fixture(scope="module")
def server(engine_process_server):
    return engine_process_server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_concurrent_streams_with_disconnects_free_every_block_in_the_engine_process(server):
    """32 concurrent streams; every third hangs up after two chunks: its abort crosses the pipe and frees its
    blocks in the engine process. The others complete."""
    results: dict[int, object] = {}

    def worker(i: int) -> None:
        # The ones that hang up ask for many tokens: a loaded machine may deliver a short completion's whole stream
        # in its first chunk (the API process reads the engine's deltas late), ending it before the hang-up.
        tokens = 96 if i % 3 == 0 else 24
        body = {"model": MODEL, "prompt": f"request {i} " + "x" * (i % 7), "max_tokens": tokens, "temperature": 0}
        try:
            with httpx.stream(
                "POST", server.url + "/v1/completions", json={**body, "ignore_eos": True, "stream": True}, timeout=60
            ) as r:
                chunks = 0
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        results[i] = ("done", chunks)
                        return
                    if line.startswith("data: "):
                        assert "error" not in json.loads(line[6:]), line
                        chunks += 1
                        if i % 3 == 0 and chunks == 2:
                            results[i] = "disconnected"
                            return
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(32):
        assert results[i] == "disconnected" if i % 3 == 0 else results[i][0] == "done", (i, results[i])
    ep = server.server.engine
    wait_engine_idle(ep)
    assert ep.stats().num_free_blocks == ep.stats().num_blocks == 96
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_a_stalled_reader_is_aborted_and_its_blocks_freed_in_the_engine_process():
    """A client that reads nothing of n = 4 x 1500 tokens is disconnected after the stall timeout; the abort
    frees its blocks in the engine process long before the request could have finished."""
    ep = EngineProcess(engine_spec(long_context_model(), num_kv_blocks=2048))
    limits = ServerLimits(stall_timeout_s=0.5, send_buffer_kb=16)
    with BackgroundServer(OpenAIServer(ep, MODEL, limits=limits)) as bs:
        body = json.dumps(
            {"model": MODEL, "prompt": "hello", "n": 4, "max_tokens": 1500, "ignore_eos": True, "logprobs": 5}
            | {"stream": True}
        ).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((bs.host, bs.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:
            eventually(lambda: metric(bs.url, 'spinwheel_connections_closed_total{reason="write_stall"}') == 1, 60)
            wait_engine_idle(ep)
            eventually(lambda: metric(bs.url, 'spinwheel_requests_total{finished_reason="abort"}') == 1)
            assert 0 < ep.stats().num_generated_tokens < 4 * 1500 / 2
        finally:
            sock.close()


@dataclass
class _FlakySpec(EngineSpec):
    """An engine whose first step raises (an engine bug on some input), built in the engine process."""

    def build(self) -> LLMEngine:
        engine = super().build()
        real_step, calls = engine.step_groups, []

        def flaky_step(stream: bool = True):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected fault")
            return real_step(stream)

        engine.step_groups = flaky_step
        return engine


@pytest.mark.slow
def test_a_failing_step_fails_only_its_requests():
    spec = engine_spec(num_kv_blocks=32)
    ep = EngineProcess(_FlakySpec(spec.model, spec.config, spec.tokenizer, 1))
    with BackgroundServer(OpenAIServer(ep, MODEL)) as bs:
        body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 3}
        r = httpx.post(bs.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        r = httpx.post(bs.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert httpx.get(bs.url + "/health").json() == {"status": "ok"}
        wait_engine_idle(ep)


def test_an_engine_that_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="engine could not start.*no/such/checkpoint"):
        EngineProcess(EngineSpec("no/such/checkpoint", EngineConfig(device="cpu"), spinwheel.Tokenizer.char_level()))


def _stream_events(url: str, body: dict, started: threading.Event, out: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                started.set()


@pytest.mark.slow
def test_an_engine_process_killed_mid_stream_fails_its_requests_then_restarts_then_exits():
    gone: list[str] = []
    model = long_context_model()
    ep = EngineProcess(engine_spec(model, num_kv_blocks=512), max_restarts=1, on_exit=gone.append)
    long = {"model": MODEL, "prompt": "hello", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    with BackgroundServer(OpenAIServer(ep, MODEL)) as bs:
        events: list[list[str]] = [[] for _ in range(4)]
        started = [threading.Event() for _ in range(4)]
        plain: dict = {}
        threads = [
            threading.Thread(target=_stream_events, args=(bs.url, long, started[i], events[i])) for i in range(4)
        ]
        threads.append(
            threading.Thread(
                target=lambda: plain.update(r=httpx.post(bs.url + "/v1/completions", json=long, timeout=60))
            )
        )
        for t in threads:
            t.start()
        assert all(s.wait(60) for s in started)
        first_pid = ep.pid
        # a hung engine process sends nothing: the stall is measured on the server's side
        assert ep.seconds_without_progress() < 1.0
        os.kill(first_pid, signal.SIGSTOP)
        time.sleep(2.0)
        assert ep.seconds_without_progress() > 1.9
        os.kill(first_pid, signal.SIGCONT)
        eventually(lambda: ep.seconds_without_progress() < 0.5, 10)
        os.kill(first_pid, signal.SIGKILL)
        killed = time.monotonic()
        seen = set()
        while time.monotonic() < killed + 5 and 503 not in seen:
            seen.add(httpx.get(bs.url + "/health").status_code)
        assert 503 in seen  # unhealthy while the engine is down
        for t in threads:
            t.join(30)
        assert time.monotonic() - killed < 30 and not any(t.is_alive() for t in threads)
        for ev in events:  # each stream ends with an error object, then [DONE]
            assert ev[-1] == "[DONE]"
            err = json.loads(ev[-2])["error"]
            assert err["type"] == "server_error" and "SIGKILL" in err["message"], err
            assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in ev[:-2])
        r = plain["r"]
        assert r.status_code == 503 and "SIGKILL" in r.json()["error"]["message"]
        # restarted: healthy again, another process, the same greedy output as the offline engine
        eventually(lambda: httpx.get(bs.url + "/health").status_code == 200, 120)
        assert ep.pid != first_pid and ep.num_restarts == 1
        ref = LLM(model, spinwheel.Tokenizer.char_level(), num_kv_blocks=512, block_size=4).generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=8)
        )
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        assert httpx.post(bs.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"] == (
            ref[0].outputs[0].text
        )
        # killed again with no restart left: reported for good, requests refused at once
        os.kill(ep.pid, signal.SIGKILL)
        eventually(lambda: bool(gone), 10)
        assert "SIGKILL" in gone[0] and "1 restart(s) allowed" in gone[0]
        assert httpx.get(bs.url + "/health").status_code == 503
        t0 = time.monotonic()
        r = httpx.post(bs.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert time.monotonic() - t0 < 2


@pytest.mark.slow
def test_spinwheel_serve_exits_with_the_reason_when_its_engine_process_dies():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "spinwheel.cli", "serve", "--model", "test", "--port", str(port)]
    command += ["--engine-restarts", "0", "--engine-num-kv-blocks", "16", "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = [proc.stdout.readline() if proc.stdout else "" for _ in range(2)]
        assert lines[0].startswith("spinwheel serve: warm-up step of "), lines  # the engine process's, first
        line = lines[1]
        assert "engine process pid" in line, lines
        pid = int(line.split("engine process pid ")[1].split(";")[0])
        eventually(lambda: _healthy(port), 60)
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(60) == 1
        output = proc.stdout.read() if proc.stdout else ""
        assert f"spinwheel serve: error: the engine process (pid {pid}) was killed by SIGKILL" in output, output
    finally:
        proc.kill()
        proc.wait(20)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_the_in_process_mode_stays_behind_an_option():
    from spinwheel.cli import build_parser
    from spinwheel.config import from_args

    ns = build_parser().parse_args(["serve", "--model", "test", "--no-engine-process", "--engine-restarts", "2"])
    config = from_args(ServeConfig, ns)
    assert config.engine_process is False and config.engine_restarts == 2
    assert from_args(ServeConfig, build_parser().parse_args(["serve"])).engine_process is True
    server = build_server(config, EngineConfig(num_kv_blocks=16, device="cpu"))
    try:
        assert isinstance(server.async_engine, AsyncEngine) and server.engine.stats().num_blocks == 16
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="--engine-restarts"):
        ServeConfig(engine_restarts=-1)
