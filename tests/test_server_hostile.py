"""The server against hostile clients (issue 12): inputs that used to answer a plain-text 500, a client that never
reads its stream, huge batches, contradictory limits, chunked oversized bodies. Each test reproduced its failure
before the fix."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from helpers import MODEL, all_blocks_free, eventually, long_context_model, metric, server_model, wait_idle

import spinwheel
from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.server import BackgroundServer, OpenAIServer
from spinwheel.server.async_engine import AsyncEngine
from spinwheel.server.limits import ServerLimits


def _engine(model=None, **config) -> LLMEngine:
    return LLMEngine(
        model or server_model(),
        spinwheel.Tokenizer.char_level(),
        EngineConfig(**{"num_kv_blocks": 64, "block_size": 4, **config}),
    )


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(OpenAIServer(_engine(), MODEL, api_key="s3cret")) as bs:
        yield bs


AUTH = {"Authorization": "Bearer s3cret", "content-type": "application/json"}


def _assert_error_object(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_non_ascii_authorization_header_is_401(server):
    for value in ("Bearer \xe9t\xe9".encode("latin-1"), "Bearer clé".encode(), b"\xff\xfe", "Béarer s3cret".encode()):
        r = httpx.post(
            server.url + "/v1/completions",
            content=b'{"model": "tiny-test", "prompt": "a"}',
            headers={"authorization": value, "content-type": "application/json"},
        )
        err = _assert_error_object(r, 401)
        assert err["code"] == "invalid_api_key"


def test_an_api_key_no_client_can_send_is_refused_at_start(capsys):
    with pytest.raises(ValueError, match="printable ASCII"):
        OpenAIServer(_engine(), MODEL, api_key="clé")
    with pytest.raises(ValueError, match="printable ASCII"):
        OpenAIServer(_engine(), MODEL, api_key="two words")
    from spinwheel.cli import main

    t0 = time.monotonic()
    assert main(["serve", "--model", "test", "--api-key", "clé"]) == 2
    assert "printable ASCII" in capsys.readouterr().err
    assert time.monotonic() - t0 < 5  # refused before the checkpoint is loaded


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "a\ud800b"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": ["\udfff"]}, "stop"),
        ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model"),
        ("/v1/completions", {"prompt": "x", "stream": True, "model": "\ud83d"}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "\ud800"}, "model"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ],
)
def test_lone_surrogates_are_400(server, path, body, param):
    body = {"model": MODEL, "max_tokens": 2, **body}
    r = httpx.post(server.url + path, content=json.dumps(body).encode(), headers=AUTH)  # json escapes as \\ud800
    err = _assert_error_object(r, 400)
    assert err["param"].startswith(param) and "Unicode" in err["message"]


def test_an_unexpected_exception_is_a_counted_500_error_object():
    engine = _engine()
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        tok = bs.server.tokenizer
        real_encode, real_decode = tok.encode, tok.decode

        def encode(text, add_special_tokens=True):
            if text == "boom":
                raise RuntimeError("injected tokenizer bug")
            return real_encode(text, add_special_tokens)

        def decode(ids, skip_special_tokens=True):
            if not skip_special_tokens:  # the logprobs' token texts
                raise KeyError("injected decode bug")
            return real_decode(ids, skip_special_tokens)

        tok.encode, tok.decode = encode, decode
        before = metric(bs.url, 'spinwheel_http_errors_total{status="500"}')
        r = httpx.post(bs.url + "/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 2})
        err = _assert_error_object(r, 500)
        assert err["type"] == "server_error" and "RuntimeError" in err["message"]
        # after the 200 of a stream went out: an error event, then [DONE]
        with httpx.stream(
            "POST",
            bs.url + "/v1/completions",
            json={"model": MODEL, "prompt": "ab", "max_tokens": 4, "logprobs": 1, "stream": True},
        ) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "KeyError" in json.loads(events[-2])["error"]["message"]
        assert metric(bs.url, 'spinwheel_http_errors_total{status="500"}') == before + 2
        tok.encode, tok.decode = real_encode, real_decode
        assert httpx.post(bs.url + "/v1/completions", json={"model": MODEL, "prompt": "ab"}).status_code == 200
        wait_idle(engine)
        assert all_blocks_free(engine)


def test_min_tokens_above_max_tokens_is_400(server):
    r = httpx.post(
        server.url + "/v1/completions",
        headers=AUTH,
        json={"model": MODEL, "prompt": "ab", "max_tokens": 3, "min_tokens": 5},
    )
    err = _assert_error_object(r, 400)
    assert err["param"] == "min_tokens" and "max_tokens=3" in err["message"]
    r = httpx.post(
        server.url + "/v1/completions",
        headers=AUTH,
        json={"model": MODEL, "prompt": "ab", "max_tokens": 5, "min_tokens": 5, "ignore_eos": False},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5  # min_tokens honoured


def test_a_chunked_oversized_body_is_413_like_a_sized_one():
    with BackgroundServer(OpenAIServer(_engine(), MODEL, max_body_bytes=4096)) as bs:
        body = json.dumps({"model": MODEL, "prompt": "x" * 10_000}).encode()

        def chunks():
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        for content in (body, chunks()):  # Content-Length, then Transfer-Encoding: chunked
            r = httpx.post(bs.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
            err = _assert_error_object(r, 413)
            assert err["code"] == "request_too_large" and "4096 bytes" in err["message"]


def test_too_many_sequences_in_one_request_is_400_before_tokenizing():
    with BackgroundServer(OpenAIServer(_engine(), MODEL, limits=ServerLimits(max_sequences_per_request=8))) as bs:
        ok = httpx.post(
            bs.url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 2}
        )
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
        for body in ({"prompt": ["a"] * 5, "n": 2}, {"prompt": [[5, 6]] * 9}, {"prompt": "a", "n": 9}):
            r = httpx.post(bs.url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
            err = _assert_error_object(r, 400)
            assert err["code"] == "too_many_sequences" and "at most 8" in err["message"]
        r = httpx.post(
            bs.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 9},
        )
        assert _assert_error_object(r, 400)["code"] == "too_many_sequences"


def test_a_big_body_does_not_stall_a_concurrent_small_request():
    """500 prompts of 4000 characters take the built-in tokenizer 1.5 s or more: off the event loop, small requests
    meanwhile are answered at once."""
    with BackgroundServer(OpenAIServer(_engine(), MODEL, max_body_bytes=8 << 20)) as bs:
        big = {"model": MODEL, "prompt": ["abcdefgh" * 500] * 500, "max_tokens": 1}
        result = {}

        def send_big():
            t0 = time.perf_counter()
            result["big"] = httpx.post(bs.url + "/v1/completions", json=big, timeout=120)
            result["big_s"] = time.perf_counter() - t0

        with httpx.Client(base_url=bs.url, timeout=30) as http:
            http.get("/v1/models")  # connection up
            thread = threading.Thread(target=send_big)
            thread.start()
            time.sleep(0.3)  # the big body is in and being tokenized
            latencies = []
            while thread.is_alive() or not latencies:
                t0 = time.perf_counter()
                assert (
                    http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code
                    == 200
                )
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)
            thread.join()
        assert result["big"].status_code == 400  # every prompt is longer than the context
        assert result["big"].json()["error"]["code"] == "context_length_exceeded"
        # on the event loop, one small request waited for nearly all of the big one
        assert len(latencies) >= 3 and max(latencies) < min(1.0, result["big_s"] / 3), (result["big_s"], latencies)


def test_a_slow_reader_gets_coalesced_outputs_and_the_same_text():
    """Outputs are cumulative: a reader that falls behind gets fewer, larger ones, never a backlog, and the same
    final output as a fast reader."""
    engine = _engine(long_context_model(), num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def read(delay_s: float, request_id: str) -> tuple[int, int, str]:
        ae_outputs, most_unread = 0, 0
        async for out in ae.generate(request_id, "hello", params):
            ae_outputs += 1
            await asyncio.sleep(delay_s)
            most_unread = max(most_unread, ae.num_unread_outputs)  # what piled up while this reader slept
            final = out
        assert final.finished and len(final.outputs[0].token_ids) == 300
        return ae_outputs, most_unread, final.outputs[0].text

    ae = AsyncEngine(engine)
    try:
        fast_n, _, fast_text = asyncio.run(read(0.0, "fast"))
        slow_n, slow_unread, slow_text = asyncio.run(read(0.05, "slow"))
    finally:
        ae.shutdown()
    assert slow_text == fast_text
    assert fast_n > 100 and slow_n < fast_n / 3  # the slow reader skipped superseded outputs
    assert slow_unread <= 1  # one request never holds more than its latest output
    assert all_blocks_free(engine)


def test_a_client_that_never_reads_is_disconnected_and_its_blocks_freed():
    """n = 4 streams with logprobs and 1500 tokens each (about 2 MB of events); the client reads nothing. The
    server's send buffers fill (16 KiB in the kernel, uvicorn's 64 KiB), the connection is dropped after the stall
    timeout, and the request is aborted long before it could have finished."""
    engine = _engine(long_context_model(), num_kv_blocks=2048)
    limits = ServerLimits(stall_timeout_s=0.5, send_buffer_kb=16)
    with BackgroundServer(OpenAIServer(engine, MODEL, limits=limits)) as bs:
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": "hello",
                "n": 4,
                "max_tokens": 1500,
                "ignore_eos": True,
                "logprobs": 5,
                "stream": True,
            }
        ).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((bs.host, bs.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:
            wait_idle(engine, timeout=30)
            assert all_blocks_free(engine)
            eventually(lambda: metric(bs.url, 'spinwheel_requests_total{finished_reason="abort"}') == 1)
            assert metric(bs.url, 'spinwheel_connections_closed_total{reason="write_stall"}') == 1
            assert engine.stats().num_generated_tokens < 4 * 1500 / 2
            assert metric(bs.url, "spinwheel_unread_outputs") == 0
        finally:
            sock.close()
        assert httpx.get(bs.url + "/health").json() == {"status": "ok"}
