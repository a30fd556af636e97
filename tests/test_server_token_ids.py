"""vLLM's ``return_token_ids`` through the official ``openai`` client (``extra_body``): the prompt's token ids and
each choice's sampled ids, equal to what the engine samples offline with the same seed, with the engine's log-probs
of those tokens (``logprobs_mode="processed"``: of the tempered distribution); ``include_stop_str_in_output``."""

import json

import httpx
import openai
import pytest

import spinwheel
from spinwheel.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from spinwheel.server import BackgroundServer, OpenAIServer

MODEL = "tiny-test"
TOK = spinwheel.Tokenizer.char_level()
EXTRA = {"return_token_ids": True, "logprobs_mode": "processed"}


def _model():
    return spinwheel.load_model("test", vocab_size=100, seed=5)


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(_model(), TOK, EngineConfig(num_kv_blocks=96, block_size=4))
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        yield bs


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _offline(prompt_ids: list[int], **params):
    llm = LLM(_model(), TOK, num_kv_blocks=96, block_size=4)
    sp = SamplingParams(logprobs=0, logprobs_mode="processed", **params)
    return llm.generate([prompt_ids], sp)[0].outputs[0]


def test_completion_token_ids_and_logprobs_equal_the_engine(client):
    r = client.completions.create(
        model=MODEL, prompt="12+34=", max_tokens=8, temperature=0.8, seed=3, logprobs=0, extra_body=EXTRA
    )
    ch = r.choices[0].model_dump()
    assert ch["prompt_token_ids"] == TOK.encode("12+34=")
    want = _offline(TOK.encode("12+34="), max_tokens=8, temperature=0.8, seed=3)
    assert ch["token_ids"] == want.token_ids and len(ch["token_ids"]) == 8
    assert ch["logprobs"]["token_logprobs"] == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)])


def test_chat_token_ids_on_the_response_and_choice(client):
    messages = [{"role": "user", "content": "7*8="}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, seed=1, logprobs=True, extra_body=EXTRA
    ).model_dump()
    prompt = TOK.encode(TOK.apply_chat_template(messages), add_special_tokens=False)
    assert r["prompt_token_ids"] == prompt
    want = _offline(prompt, max_tokens=6, seed=1)
    ch = r["choices"][0]
    assert ch["token_ids"] == want.token_ids
    assert [e["logprob"] for e in ch["logprobs"]["content"]] == pytest.approx(
        [lp[t] for t, lp in zip(want.token_ids, want.logprobs)]
    )


def test_without_the_field_no_token_ids(client):
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=3).model_dump()
    assert "token_ids" not in r["choices"][0] and "prompt_token_ids" not in r["choices"][0]


def test_stop_string_kept_on_request_and_its_tokens_always_returned(client):
    first = client.completions.create(model=MODEL, prompt="ab", max_tokens=12, temperature=0, extra_body=EXTRA)
    stop = first.choices[0].text[3:5]
    for keep in (False, True):
        body = {**EXTRA, "include_stop_str_in_output": keep}
        r = client.completions.create(
            model=MODEL, prompt="ab", max_tokens=12, temperature=0, stop=[stop], extra_body=body
        )
        ch = r.choices[0].model_dump()
        assert ch["text"].endswith(stop) == keep
        assert TOK.decode(ch["token_ids"]).endswith(stop)  # the sampled tokens, stop string included


def test_streamed_token_ids_add_up(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 7, "seed": 2, "stream": True, **EXTRA}
    ids, prompt = [], None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                prompt = ch.get("prompt_token_ids", prompt)
                ids += ch.get("token_ids", [])
    assert prompt == TOK.encode("hello")
    assert ids == _offline(TOK.encode("hello"), max_tokens=7, seed=2).token_ids
