"""``/tokenize``, ``/detokenize`` and ``/version`` in vLLM's shapes, checked against the tokenizer itself and
against what ``/v1/chat/completions`` counts as its prompt."""

import httpx
import pytest
from helpers import MODEL, server_model

import spinwheel
from spinwheel.engine import EngineConfig, LLMEngine
from spinwheel.server import BackgroundServer, OpenAIServer


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(server_model(), spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=32))
    with BackgroundServer(OpenAIServer(engine, MODEL, api_key="k")) as bs:
        yield bs


def _post(server, path, body, key="k"):
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"})


def test_tokenize_a_prompt(server):
    tok = server.server.tokenizer
    r = _post(server, "/tokenize", {"model": MODEL, "prompt": "12+34="})
    assert r.status_code == 200
    ids = tok.encode("12+34=")
    assert r.json() == {"count": len(ids), "max_model_len": 128, "tokens": ids, "token_strs": None}
    assert ids[0] == tok.bos_id  # special tokens added by default, as for a completion prompt
    r = _post(server, "/tokenize", {"prompt": "ab", "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["tokens"] == tok.encode("ab", add_special_tokens=False) and r.json()["token_strs"] == ["a", "b"]


def test_tokenize_messages_counts_what_chat_completions_counts(server):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}]
    r = _post(server, "/tokenize", {"model": MODEL, "messages": messages})
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    tok = server.server.tokenizer
    assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_detokenize_round_trips(server):
    tok = server.server.tokenizer
    ids = _post(server, "/tokenize", {"prompt": "hello world"}).json()["tokens"]
    r = _post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"].endswith("hello world")


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/tokenize", {"model": MODEL}, 400),  # neither prompt nor messages
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404),
        ("/tokenize", {"prompt": 5}, 400),
        ("/detokenize", {"tokens": [1, 10**6]}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": "abc"}, 400),
    ],
)
def test_bad_tokenize_requests_get_error_objects(server, path, body, status):
    r = _post(server, path, body)
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenize_needs_the_key_and_version_does_not(server):
    assert _post(server, "/tokenize", {"prompt": "a"}, key="wrong").status_code == 401
    assert _post(server, "/detokenize", {"tokens": [5]}, key="wrong").status_code == 401
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": spinwheel.__version__}
