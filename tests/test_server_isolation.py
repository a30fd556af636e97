"""One request never fails the others (issue 28, item 1), over HTTP: beam-search parameters that used to raise
inside the engine (``length_penalty`` 700, 1e308, -inf) or return an empty 200 (NaN, -700) are a 400 naming the
field; and a request the engine fails on anyway (validation bypassed) gets a 500 of its own while the requests
running beside it get their 200s with the text they get alone — in both engine modes. Before the fix every request
in flight got the 500."""

import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
from helpers import MODEL, all_blocks_free, engine_spec, server_model, wait_engine_idle, wait_idle

import spinwheel
from spinwheel.engine import EngineConfig, LLMEngine
from spinwheel.server import BackgroundServer, OpenAIServer
from spinwheel.server.api.params import ServedModel
from spinwheel.server.engine_client import EngineProcess
from spinwheel.server.engine_process import EngineSpec


def _engine() -> LLMEngine:
    return LLMEngine(server_model(), spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=96, block_size=4))


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(OpenAIServer(_engine(), MODEL)) as bs:
        yield bs


def _post_json(url: str, body: dict) -> httpx.Response:
    """POST ``body`` as Python's json writes it: NaN and +-Infinity as bare words, which the server's parser reads."""
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)


BEAM = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "n": 2, "use_beam_search": True}
CHAT_BEAM = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "n": 2}


@pytest.mark.parametrize("value", [700, 1e308, float("-inf"), float("inf"), float("nan"), -700])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_extreme_length_penalty_is_a_400_naming_it(server, path, value):
    body = (BEAM if path == "/v1/completions" else {**CHAT_BEAM, "use_beam_search": True}) | {"length_penalty": value}
    r = _post_json(server.url + path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "length_penalty" and "[-10, 10]" in err["message"], err


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_an_infinite_temperature_or_penalty_is_a_400(server, field):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, field: float("inf")}
    r = _post_json(server.url + "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


POISON_MARK = 1.25  # a valid length_penalty that the patched mapping below turns into one that raises in the engine
STOP_MARK = 0.125  # a valid frequency_penalty that the patched mapping turns into a stop "string" that is an int


@pytest.fixture
def poison_after_validation(monkeypatch):
    """Requests with ``length_penalty == POISON_MARK`` reach the engine with 700, those with ``frequency_penalty ==
    STOP_MARK`` with ``stop=[5]``, which raises where stop strings are checked (the engine's output processor on
    a thread; the API process's delta decoder with an engine process): what a validation gap would let through."""
    real = ServedModel.sampling_params

    def sampling_params(self, body, *args, **kwargs):
        params = real(self, body, *args, **kwargs)
        if body.length_penalty == POISON_MARK:
            params.length_penalty = 700.0
        if body.frequency_penalty == STOP_MARK:
            params.stop = [5]
        return params

    monkeypatch.setattr(ServedModel, "sampling_params", sampling_params)


def _normal(i: int) -> dict:
    return {"model": MODEL, "prompt": f"request {i}", "max_tokens": 110, "ignore_eos": True, "temperature": 0}


def _post_all(url: str, bodies: dict[str, dict], engine) -> dict[str, tuple[httpx.Response, float]]:
    """POST every body concurrently, "poisoned" once the engine runs the others; (response, time answered) by
    name."""
    results: dict[str, tuple[httpx.Response, float]] = {}

    def post(name: str) -> None:
        while name == "poisoned" and not engine.has_unfinished_requests():
            time.sleep(0.005)
        r = httpx.post(url + "/v1/completions", json=bodies[name], timeout=120)
        results[name] = (r, time.monotonic())

    threads = [threading.Thread(target=post, args=(name,)) for name in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


POISONED = {
    "beam": (BEAM | {"length_penalty": POISON_MARK}, "OverflowError"),
    "stop": ({"model": MODEL, "prompt": "hello", "max_tokens": 8, "frequency_penalty": STOP_MARK}, "TypeError"),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "kind"), [("thread", "beam"), ("process", "beam"), ("thread", "stop"), ("process", "stop")]
)
def test_a_request_the_engine_fails_on_fails_alone(mode, kind, poison_after_validation):
    engine = _engine() if mode == "thread" else EngineProcess(engine_spec())
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        bodies = {f"normal{i}": _normal(i) for i in range(4)}
        alone = {name: httpx.post(bs.url + "/v1/completions", json=b, timeout=120).json() for name, b in bodies.items()}
        bodies["poisoned"], exception = POISONED[kind]
        results = _post_all(bs.url, bodies, engine)
        r, poisoned_at = results.pop("poisoned")
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and exception in err["message"] and "not affected" in err["message"]
        for name, (r, answered_at) in results.items():
            assert r.status_code == 200, (name, r.text)
            assert r.json()["choices"][0]["text"] == alone[name]["choices"][0]["text"]
        assert poisoned_at < max(t for _, t in results.values())  # it failed while others were still running
        assert httpx.get(bs.url + "/health").json() == {"status": "ok"}
        if mode == "thread":
            wait_idle(engine)
            assert all_blocks_free(engine)
        else:
            wait_engine_idle(engine)


@dataclass
class _UnencodableSpec(EngineSpec):
    """An engine process whose outputs of beam requests with ``length_penalty == POISON_MARK`` cannot be built
    (the engine process encodes beams through its output processor)."""

    def build(self) -> LLMEngine:
        engine = super().build()
        build = engine.output_processor.request_output

        def request_output(group):
            if group.params.length_penalty == POISON_MARK:
                raise RuntimeError("cannot encode this one")
            return build(group)

        engine.output_processor.request_output = request_output
        return engine


@pytest.mark.slow
def test_a_request_whose_output_the_engine_process_cannot_send_fails_alone():
    spec = engine_spec()
    engine = EngineProcess(_UnencodableSpec(spec.model, spec.config, spec.tokenizer, spec.num_threads))
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        bodies = {f"normal{i}": _normal(i) for i in range(3)}
        alone = {name: httpx.post(bs.url + "/v1/completions", json=b, timeout=120).json() for name, b in bodies.items()}
        bodies["poisoned"] = BEAM | {"length_penalty": POISON_MARK}
        results = _post_all(bs.url, bodies, engine)
        r, _ = results.pop("poisoned")
        assert r.status_code == 500 and "cannot encode this one" in r.json()["error"]["message"], r.text
        for name, (r, _) in results.items():
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone[name]["choices"][0]["text"]
        assert engine.num_restarts == 0 and httpx.get(bs.url + "/health").json() == {"status": "ok"}
        wait_engine_idle(engine)
