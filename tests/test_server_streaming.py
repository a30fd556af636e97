"""The shared SSE path: a choice that finishes before its siblings gets no chunk after its finish_reason, in both
endpoints, and its text is still the non-streamed one."""

import json

import httpx
import pytest
from helpers import BOTH_ENGINE_MODES, MODEL, server_model

import spinwheel
from spinwheel.engine import EngineConfig, LLMEngine
from spinwheel.server import BackgroundServer, OpenAIServer


@pytest.fixture(scope="module")
def server(request):
    """The engine on a thread; the session's engine-process server for the `process` case of BOTH_ENGINE_MODES."""
    if getattr(request, "param", "thread") == "process":
        yield request.getfixturevalue("engine_process_server")
        return
    engine = LLMEngine(server_model(), spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=64, block_size=4))
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        yield bs


def _stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@BOTH_ENGINE_MODES
@pytest.mark.parametrize(
    "path,body,text_of",
    [
        ("/v1/completions", {"prompt": "ab", "logprobs": 1}, lambda ch: ch.get("text") or ""),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "ab"}], "logprobs": True, "top_logprobs": 1},
            lambda ch: ch["delta"].get("content") or "",
        ),
    ],
)
def test_no_chunks_after_a_choice_finished(server, path, body, text_of):
    early = 0
    for seed in range(6):
        request = {"model": MODEL, "n": 4, "max_tokens": 20, "seed": seed, "stop": ["e", "a"], **body}
        texts, finished_at, chunks = {}, {}, _stream(server, path, request)
        for k, chunk in enumerate(chunks):
            for ch in chunk["choices"]:
                assert ch["index"] not in finished_at, f"chunk {k} for choice {ch['index']} after its finish"
                texts[ch["index"]] = texts.get(ch["index"], "") + text_of(ch)
                if ch["finish_reason"]:
                    finished_at[ch["index"]] = k
        assert sorted(finished_at) == [0, 1, 2, 3]
        early += len(set(finished_at.values())) > 1  # choices finished at different chunks
        whole = httpx.post(server.url + path, json=request, timeout=60).json()["choices"]
        assert [texts[i] for i in range(4)] == [c.get("text", c.get("message", {}).get("content")) for c in whole]
    assert early >= 3  # the case under test happened
