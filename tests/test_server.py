"""The OpenAI-compatible server, on a real loopback socket, driven by the official ``openai`` client and httpx:
results equal the offline LLM's, disconnects free their blocks, hostile input gets 4xx and the server keeps
serving."""

import json
import random
import threading
import time

import httpx
import openai  # the official client (a test dependency)
import pytest
import torch
from helpers import BOTH_ENGINE_MODES, MODEL, PROMPTS, all_blocks_free, server_model, wait_idle

import spinwheel
from spinwheel.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from spinwheel.server import BackgroundServer, OpenAIServer


@pytest.fixture(scope="module")
def server(request):
    """The engine on a thread; the session's engine-process server for the `process` case of BOTH_ENGINE_MODES."""
    if getattr(request, "param", "thread") == "process":
        yield request.getfixturevalue("engine_process_server")
        return
    engine = LLMEngine(server_model(), spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=96, block_size=4))
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        yield bs


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return LLM(server_model(), spinwheel.Tokenizer.char_level(), num_kv_blocks=96, block_size=4)


@BOTH_ENGINE_MODES
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


@BOTH_ENGINE_MODES
def test_greedy_completions_equal_offline_llm(client, offline):
    ref = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    tok = offline.tokenizer
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert resp.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)
    # streamed: the concatenated deltas are the same text, and each choice ends with a finish_reason
    texts, reasons = {}, {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert [texts[i] for i in range(len(PROMPTS))] == [r.outputs[0].text for r in ref]
    assert [reasons[i] for i in range(len(PROMPTS))] == [r.outputs[0].finish_reason for r in ref]
    # token-id prompts
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref[:2]]


@BOTH_ENGINE_MODES
def test_chat_equals_offline_llm_on_the_rendered_template(client, offline):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}]
    prompt_ids = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    (ref,) = offline.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=10))
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


@BOTH_ENGINE_MODES
def test_n_seed_stop_and_logprobs(client, offline):
    resp = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in resp.choices] == list(range(6))
    again = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [c.text for c in resp.choices] == [c.text for c in again.choices]  # per-request seed: reproducible
    # stop strings: the text ends before the first occurrence of the stop string
    full = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=0).choices[0].text
    stop = full[3:5]
    cut = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="hello", max_tokens=16, temperature=0, stop=[stop], stream=True
        )
    )
    assert streamed == cut.choices[0].text
    # logprobs equal the model's log-softmax at each step
    resp = client.completions.create(model=MODEL, prompt="7*8=", max_tokens=4, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp.tokens and "".join(lp.tokens) == resp.choices[0].text
    tok = offline.tokenizer
    ids = tok.encode("7*8=")
    with torch.no_grad():
        for t, (token, token_lp, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
            logp = torch.log_softmax(offline.model(torch.tensor([ids]))[0, -1], -1)
            nxt = tok.encode(token, add_special_tokens=False)[0]
            assert token_lp == pytest.approx(logp[nxt].item(), abs=1e-4)
            assert len(top) == 3 and max(top.values()) == pytest.approx(logp.max().item(), abs=1e-4)
            ids.append(nxt)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_auth_and_body_limit():
    engine = LLMEngine(server_model(), spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=32))
    with BackgroundServer(OpenAIServer(engine, MODEL, api_key="s3cret", max_body_bytes=2048)) as bs:
        body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 2}
        r = httpx.post(bs.url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(bs.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        good = openai.OpenAI(base_url=bs.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="1+1=", max_tokens=2).choices[0].finish_reason
        r = httpx.post(
            bs.url + "/v1/completions", headers={"Authorization": "Bearer s3cret"}, json={**body, "prompt": "x" * 5000}
        )
        assert r.status_code == 413 and "exceeds 2048 bytes" in r.json()["error"]["message"]
        assert httpx.get(bs.url + "/health").status_code == 200  # health stays open


def test_concurrent_streams_with_disconnects_free_every_block(server):
    """32 concurrent streaming clients; every third hangs up after two chunks. The rest complete in full."""
    results: dict[int, object] = {}

    def worker(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"request {i} " + "x" * (i % 7),
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                chunks, done = 0, False
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    payload = json.loads(line[6:])
                    assert "error" not in payload, payload
                    chunks += 1
                    if i % 3 == 0 and chunks == 2:
                        results[i] = "disconnected"
                        return  # closing the response drops the connection mid-stream
                results[i] = ("done", chunks, done)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(32):
        if i % 3 == 0:
            assert results[i] == "disconnected"
        else:
            assert isinstance(results[i], tuple) and results[i][2], (i, results[i])
            assert results[i][1] >= 2  # the text arrived in several chunks
    engine = server.server.engine
    wait_idle(engine)
    assert all_blocks_free(engine), engine.block_manager.block_tables
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def _hostile_bodies(rng: random.Random) -> list:
    weird = [None, True, -1, 0, 1.5, 10**30, -(10**30), "", "x" * 300, [], {}, [1, "a"], {"a": 1}, float("nan")]
    fields = [
        "prompt",
        "messages",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "seed",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "stream",
        "model",
        "top_logprobs",
        "stop_token_ids",
        "min_tokens",
        "echo",
        "stream_options",
        "suffix",
        "max_completion_tokens",
    ]
    bodies: list = []
    for _ in range(150):
        body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 4}
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(fields)] = rng.choice(weird)
        bodies.append(("/v1/completions", body))
    for _ in range(80):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(fields)] = rng.choice(weird)
        bodies.append(("/v1/chat/completions", body))
    fixed = [
        {"model": MODEL, "prompt": "x", "n": 0},
        {"model": MODEL, "prompt": "x", "max_tokens": 0},
        {"model": MODEL, "prompt": "x", "max_tokens": 10**9},
        {"model": MODEL, "prompt": "x" * 500},
        {"model": "no-such-model", "prompt": "x"},
        {"model": MODEL, "prompt": [[]]},
        {"model": MODEL, "prompt": [10**6]},
        {"model": MODEL, "prompt": [-3]},
        {"model": MODEL, "prompt": "x", "n": 10**9},
        {"model": MODEL, "prompt": "x", "logprobs": 999},
        {"model": MODEL, "prompt": "x", "seed": 2**70},
        {"model": MODEL, "prompt": "x", "stop": [""]},
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        {"prompt": "x"},
        [1, 2, 3],
        "just a string",
        42,
        None,
    ]
    bodies += [("/v1/completions", b) for b in fixed] + [("/v1/chat/completions", b) for b in fixed]
    raw = [b"{bad json", b"", b"\xff\xfe\x00", b'{"model": ' * 50, b"[" * 5000, b"null", b'{"prompt": "\\ud800"}']
    bodies += [("/v1/completions", r) for r in raw] + [("/v1/chat/completions", r) for r in raw]
    return bodies


def test_hostile_requests_get_4xx_and_the_server_keeps_serving(server, client, offline):
    rng = random.Random(0)
    statuses = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body in _hostile_bodies(rng):
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(
                    path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
                )
            statuses.append(r.status_code)
            assert r.status_code < 500, (path, body, r.status_code, r.text)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
            elif "text/event-stream" in r.headers.get("content-type", ""):
                assert r.text.rstrip().endswith("data: [DONE]")
        for method, path in (("GET", "/v1/nothing"), ("DELETE", "/v1/completions"), ("GET", "/v1/completions")):
            r = http.request(method, path)
            assert r.status_code in (404, 405) and "error" in r.json()
    assert len(statuses) >= 250 and sum(s >= 400 for s in statuses) >= 150
    # still serving, correctly, with every block back
    ref = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8))
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]
    wait_idle(server.server.engine)
    assert all_blocks_free(server.server.engine)


@BOTH_ENGINE_MODES
def test_metrics_are_prometheus_text(server, client):
    client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "spinwheel_num_requests_running",
        "spinwheel_num_requests_waiting",
        "spinwheel_num_requests_swapped",
        "spinwheel_kv_cache_usage_ratio",
        "spinwheel_num_preemptions_total",
        "spinwheel_prefix_cache_hit_rate",
        "spinwheel_generation_tokens_total",
        "spinwheel_time_to_first_token_seconds_bucket",
        "spinwheel_e2e_request_latency_seconds_count",
        "spinwheel_inter_token_latency_seconds_count",
    ):
        assert name in text, name
    generated = [line for line in text.splitlines() if line.startswith("spinwheel_generation_tokens_total ")]
    assert float(generated[0].split()[1]) > 0


def test_an_engine_failure_fails_only_the_requests_in_flight():
    engine = LLMEngine(server_model(), spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=32))
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step(stream=True):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real_step(stream)

    engine.step = flaky_step
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        r = httpx.post(bs.url + "/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": 3}, timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        r = httpx.post(bs.url + "/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert httpx.get(bs.url + "/health").json() == {"status": "ok"}
        wait_idle(engine)
        assert all_blocks_free(engine)


@pytest.mark.slow
def test_spinwheel_serve_command(tmp_path):
    """The real command in a subprocess: binds loopback, serves the preset, stops cleanly."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spinwheel.cli",
            "serve",
            "--model",
            "test",
            "--port",
            str(port),
            "--api-key",
            "k",
            "--engine-num-kv-blocks",
            "16",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["test"]
        r = c.chat.completions.create(model="test", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(20)


def test_serve_bounds_the_tokens_of_a_step_that_decodes():
    from spinwheel.server.serve import serving_defaults

    assert serving_defaults(EngineConfig()).max_num_batched_tokens_with_decodes == 768
    assert serving_defaults(EngineConfig(max_num_batched_tokens=512)).max_num_batched_tokens_with_decodes == 512
    wide = EngineConfig(max_num_seqs=1536, max_num_batched_tokens=4096)
    assert serving_defaults(wide).max_num_batched_tokens_with_decodes == 1536  # every sequence still decodes
    given = EngineConfig(max_num_batched_tokens_with_decodes=300)
    assert serving_defaults(given).max_num_batched_tokens_with_decodes == 300
    assert EngineConfig().max_num_batched_tokens_with_decodes is None  # offline: every step takes the full budget
