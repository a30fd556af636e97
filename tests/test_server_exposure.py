"""What the server tells or does for anyone who asks (issue 28, item 7): no redirect built from the client's Host
header, no engine pid or exception text on the unauthenticated ``/health``, and special tokens typed in a chat
message kept as text when the server is told to (``--no-special-tokens-in-content``). Each failed before the fix."""

import logging
import time

import httpx
import pytest

import spinwheel
from spinwheel.engine import EngineConfig, LLMEngine
from spinwheel.server import BackgroundServer, OpenAIServer

MODEL = "tiny-test"
EOS, BOS = 2, 1  # the built-in tokenizer's


def _engine() -> LLMEngine:
    model = spinwheel.load_model("test", vocab_size=100, seed=5)
    return LLMEngine(model, spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=64, block_size=4))


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(OpenAIServer(_engine(), MODEL, api_key="s3cret")) as bs:
        yield bs


SLASHED = [("POST", "/v1/completions/"), ("GET", "/v1/models/"), ("GET", "/health/")]


@pytest.mark.parametrize(("method", "path"), SLASHED)
def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_clients_host(server, method, path):
    r = httpx.request(method, server.url + path, headers={"Host": "evil.example"}, json={}, follow_redirects=False)
    assert r.status_code == 404, (r.status_code, r.headers)
    assert "location" not in r.headers
    assert r.json()["error"]["type"] == "not_found_error"


def test_health_names_no_process_and_no_exception_but_the_log_does(caplog):
    engine = _engine()
    secret = "RuntimeError at /srv/models/private pid 4242"
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        assert httpx.get(bs.url + "/health").json() == {"status": "ok"}

        def broken() -> bool:
            raise RuntimeError(secret)

        engine.has_unfinished_requests = broken  # the engine thread's next look at its work kills it
        with caplog.at_level(logging.ERROR):
            deadline = time.monotonic() + 10
            while (r := httpx.get(bs.url + "/health")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "engine_stopped" and "server log" in err["message"]
        assert secret not in r.text and "4242" not in r.text
        assert secret in caplog.text  # the details are in the log


def _tokenize(url: str, content: str) -> list[int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "add_generation_prompt": True}
    r = httpx.post(url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_special_tokens_in_chat_content_are_parsed_by_default_and_text_when_told():
    tok = spinwheel.Tokenizer.char_level()
    with (
        BackgroundServer(OpenAIServer(_engine(), MODEL)) as parsed,
        BackgroundServer(OpenAIServer(_engine(), MODEL, special_tokens_in_content=False)) as text_only,
    ):
        typed = "say <eos> then <bos>"
        default = _tokenize(parsed.url, typed)
        assert default.count(EOS) == 1 and default.count(BOS) == 2  # the template's BOS and the typed one
        ids = _tokenize(text_only.url, typed)
        assert EOS not in ids and ids.count(BOS) == 1 and ids[0] == BOS  # only the template's own BOS
        assert tok.decode(ids, skip_special_tokens=False).count("<eos>") == 1  # the typed text, as characters
        assert len(ids) == len(default) + 2 * (len("<eos>") - 1)
        # content without a special token's text is tokenized the same either way
        assert _tokenize(text_only.url, "plain 12+34=") == _tokenize(parsed.url, "plain 12+34=")
        # and what /tokenize counts is what the chat endpoint runs
        body = {"model": MODEL, "messages": [{"role": "user", "content": typed}], "max_tokens": 1}
        r = httpx.post(text_only.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)


def test_the_serve_option_reaches_the_server():
    from spinwheel.cli import build_parser
    from spinwheel.config import from_args
    from spinwheel.server import ServeConfig

    parse = build_parser().parse_args
    assert from_args(ServeConfig, parse(["serve"])).special_tokens_in_content is True
    config = from_args(ServeConfig, parse(["serve", "--no-special-tokens-in-content"]))
    assert config.special_tokens_in_content is False


@pytest.mark.parametrize(
    ("header", "status"),
    [("Bearer s3cret", 200), ("bearer s3cret", 200), ("BEARER   s3cret", 200), ("Basic s3cret", 401), ("s3cret", 401)],
)
def test_the_authorization_forms_the_readme_documents(server, header, status):
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": header}).status_code == status
