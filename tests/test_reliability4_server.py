"""What the server sends back stays valid and small whatever comes in (issue 37, reliability items 2 and 5): a model
whose log-probs are NaN or -inf answers in strict JSON (null and vLLM's -9999.0, never ``NaN`` / ``-Infinity``),
streamed or not; a name or key the client sent is echoed truncated, so a 1 MB model name is not a 1 MB 404."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers import MODEL, server_model

import spinwheel
from spinwheel.engine import EngineConfig, LLMEngine
from spinwheel.server import BackgroundServer, OpenAIServer
from spinwheel.server.api.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs


def strict(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity (Python's json accepts them; JSON does not)."""

    def refuse(constant: str):
        raise ValueError(f"non-JSON number {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def server():
    """The server tests' model with one vocabulary row of the output layer NaN: every log-prob it gives is NaN."""
    model = server_model()
    with torch.no_grad():
        model.lm_head.weight[7] = float("nan")
    engine = LLMEngine(model, spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=64, block_size=4))
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        yield bs


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "ab", "logprobs": 2, "echo": True}),
        ("/v1/completions", {"prompt": "ab", "logprobs": 2, "prompt_logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 2}),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_non_finite_logprobs_are_answered_in_strict_json(server, path, body, stream):
    request = {"model": MODEL, "max_tokens": 3, "temperature": 0, **body, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + path, json=request, timeout=60) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 2  # under load a stream's steps may arrive as one chunk
        for event in events[:-1]:
            strict(event)  # every chunk parses as JSON
        return
    r = httpx.post(server.url + path, json=request, timeout=60)
    assert r.status_code == 200, r.text
    strict(r.text)


def test_logprob_shapes_map_nan_to_null_and_minus_infinity_to_minus_9999():
    tok = spinwheel.Tokenizer.char_level()
    nan, inf = float("nan"), float("inf")
    ids = tok.encode("ab", add_special_tokens=False)
    lps = [{ids[0]: nan, ids[1]: -inf}, {ids[1]: -inf, ids[0]: -0.5}]
    out = completion_logprobs(tok, ids, lps, 0, 2)
    assert out["token_logprobs"] == [None, -9999.0]
    assert sorted(v for v in out["top_logprobs"][1].values()) == [-9999.0, -0.5]
    chat = chat_logprobs(tok, ids, lps, 2)["content"]
    assert [c["logprob"] for c in chat] == [None, -9999.0]
    prompt = prompt_logprobs(tok, ids, [None, lps[1]], [None, 2], 2)
    assert prompt[1][str(ids[1])]["logprob"] == -9999.0
    strict(json.dumps([out, chat, prompt]))


@pytest.fixture(scope="module")
def plain_server():
    engine = LLMEngine(server_model(), spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=64, block_size=4))
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        yield bs


def test_an_unknown_model_name_is_echoed_truncated(plain_server):
    name = "m" * 1_000_000
    r = httpx.post(plain_server.url + "/v1/completions", json={"model": name, "prompt": "ab"}, timeout=60)
    assert r.status_code == 404
    assert len(r.content) < 2000
    message = r.json()["error"]["message"]
    assert message.startswith("the model 'mmmm") and "…" in message and "does not exist" in message


@pytest.mark.parametrize(
    "body",
    [
        {"logit_bias": {"k" * 1_000_000: 1}},  # a key that is no token id, echoed in the message
        {"logit_bias": {"k" * 1_000_000: "x"}},  # a value of the wrong type: the key is in the validation error's path
        {"stop": "s" * 1_000_000, "max_tokens": "x"},
    ],
)
def test_other_errors_do_not_echo_a_huge_input_whole(plain_server, body):
    r = httpx.post(plain_server.url + "/v1/completions", json={"model": MODEL, "prompt": "ab", **body}, timeout=60)
    assert r.status_code == 400
    assert len(r.content) < 4000, r.content[:300]
