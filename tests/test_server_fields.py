"""Request fields a client may rely on, served or refused, never ignored (issue 12 item 10): ``logit_bias``,
``best_of``, beam search, ``prompt_logprobs`` and ``echo`` with logprobs (the official ``openai`` client), a 400
for ``response_format`` / tool calling; and ``/health`` answering 503 when the engine stalls."""

import math
import threading
import time

import httpx
import openai  # the official client (a test dependency)
import pytest
import torch
from helpers import BOTH_ENGINE_MODES

import spinwheel
from spinwheel.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from spinwheel.server import BackgroundServer, OpenAIServer
from spinwheel.server.api.chat import render_chat
from spinwheel.server.api.protocol import ChatMessage
from spinwheel.server.limits import ServerLimits

MODEL = "tiny-test"
TOK = spinwheel.Tokenizer.char_level()


def _model():
    return spinwheel.load_model("test", vocab_size=100, seed=5)


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def dense():
    return _model()


@pytest.fixture(scope="module")
def server(request):
    """The engine on a thread; the session's engine-process server for the `process` case of BOTH_ENGINE_MODES."""
    if getattr(request, "param", "thread") == "process":
        yield request.getfixturevalue("engine_process_server")
        return
    engine = LLMEngine(_model(), TOK, EngineConfig(num_kv_blocks=96, block_size=4))
    with BackgroundServer(OpenAIServer(engine, MODEL)) as bs:
        yield bs


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return LLM(_model(), TOK, num_kv_blocks=96, block_size=4)


def _post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)


def _dense_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, V) log-softmax of one full forward: row t predicts token t + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]), attn_metadata=None)[0].float(), dim=-1)


# ---- logit_bias ----
@BOTH_ENGINE_MODES
def test_logit_bias_plus_100_forces_a_token(server):
    z = _ids("z")[0]
    for temperature in (0.0, 1.0):
        r = _post(server, {"prompt": "12+34=", "max_tokens": 8, "temperature": temperature, "seed": 3,
                           "ignore_eos": True, "logit_bias": {str(z): 100}})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "z" * 8


@BOTH_ENGINE_MODES
def test_logit_bias_minus_100_bans_a_token_as_a_naive_greedy_loop_does(server, dense):
    prompt = TOK.encode("hello")
    plain = _post(server, {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}).json()
    banned = _ids(plain["choices"][0]["text"][0])[0]  # the first greedy token
    bias = {banned: -100.0, _ids("e")[0]: 2.5}
    r = _post(server, {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                       "logit_bias": {str(k): v for k, v in bias.items()}})  # fmt: skip
    got = _ids(r.json()["choices"][0]["text"])
    ids = list(prompt)  # reference: argmax of the full forward's last logits plus the bias, token by token
    with torch.no_grad():
        for _ in range(10):
            logits = dense(torch.tensor([ids]), attn_metadata=None)[0, -1].float()
            for k, v in bias.items():
                logits[k] += v
            ids.append(int(logits.argmax()))
    assert got == ids[len(prompt) :] and banned not in got


@pytest.mark.parametrize(
    ("bias", "needle"),
    [({"100": 1}, "outside the vocabulary"), ({"x1": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
     ({"5": -100.5}, "[-100, 100]")],
)  # fmt: skip
def test_bad_logit_bias_is_400(server, bias, needle):
    r = _post(server, {"prompt": "ab", "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert needle in r.json()["error"]["message"]


# ---- best_of and beam search ----
@BOTH_ENGINE_MODES
def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(server):
    body = {"prompt": "The quick", "max_tokens": 6, "temperature": 1.0, "seed": 11, "logprobs": 0, "ignore_eos": True}
    every = _post(server, {**body, "n": 6}).json()["choices"]  # the same 6 seeded samples best_of=6 draws
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert len({c["text"] for c in every}) > 2
    best = _post(server, {**body, "n": 2, "best_of": 6}).json()
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    lps = [sum(c["logprobs"]["token_logprobs"]) for c in best["choices"]]
    assert lps[0] >= lps[1] >= max(sum(c["logprobs"]["token_logprobs"]) for c in ranked[2:])
    # chat takes best_of too
    chat = _post(server, {"messages": [{"role": "user", "content": "hi"}], "n": 1, "best_of": 3, "max_tokens": 4,
                          "seed": 2}, "/v1/chat/completions")  # fmt: skip
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 1


@BOTH_ENGINE_MODES
def test_beam_search_through_the_api_equals_the_offline_beam_search(server, offline):
    prompt = "7*8="
    for width, n in ((4, 2), (3, 3)):
        ref = offline.beam_search([prompt], beam_width=width, max_tokens=6)[0]
        body = {"prompt": prompt, "max_tokens": 6, "use_beam_search": True, "n": n}
        r = _post(server, {**body, "best_of": width} if width != n else body)
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [o.text for o in ref.outputs[:n]]
    messages = [ChatMessage(role="user", content="hi")]
    ref = offline.beam_search([render_chat(TOK, messages, True)], beam_width=3, max_tokens=5)[0]
    r = _post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "use_beam_search": True,
                       "n": 2, "best_of": 3}, "/v1/chat/completions")  # fmt: skip
    assert [c["message"]["content"] for c in r.json()["choices"]] == [o.text for o in ref.outputs[:2]]


def test_a_body_sent_without_the_json_content_type_is_named(server):
    """``curl -d '{...}'`` sends form-encoded: the 400 says to send JSON with its content type (was pydantic's
    'Input should be a valid dictionary or object to extract fields from')."""
    body = b'{"model": "tiny-test", "prompt": "ab", "max_tokens": 2}'
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers, timeout=60)
        assert r.status_code == 400, r.text
        assert "send the body as JSON with Content-Type: application/json" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"n": 3, "best_of": 2}, "best_of", "must be >= n"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of", "cannot stream"),
        ({"use_beam_search": True, "n": 2, "stream": True}, "stream", "cannot stream"),
        ({"use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs", "beam search"),
        ({"use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p", "beam search"),
        ({"use_beam_search": True, "n": 2, "logit_bias": {"5": 1}}, "logit_bias", "beam search"),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "not supported"),
        ({"best_of": 65}, "best_of", "less than or equal to 64"),
    ],
)
def test_unservable_combinations_are_400(server, body, param, needle):
    r = _post(server, {"prompt": "ab", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, 400, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice"),
        ({"functions": [{"name": "f"}]}, 400, "functions"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}, 200, None),
        ({"response_format": {"type": "text"}}, 200, None),
    ],
)
def test_tool_calling_is_refused_unless_off(server, body, status, param):
    r = _post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body},
              "/v1/chat/completions")  # fmt: skip
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == param and "not supported" in r.json()["error"]["message"]


# ---- prompt logprobs and echo ----
@BOTH_ENGINE_MODES
def test_prompt_logprobs_as_vllm_returns_them(server, dense):
    text = "The quick brown"
    messages = [{"role": "user", "content": text}]
    for path, body, prompt in (
        ("/v1/completions", {"prompt": text}, TOK.encode(text)),
        ("/v1/chat/completions", {"messages": messages}, render_chat(TOK, [ChatMessage(**messages[0])], True)),
    ):
        r = _post(server, {**body, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}, path).json()
        got = r["choices"][0]["prompt_logprobs"] if "prompt" in body else r["prompt_logprobs"]
        ref = _dense_logprobs(dense, prompt)
        assert got[0] is None and len(got) == len(prompt)
        for pos in range(1, len(prompt)):
            row, token = ref[pos - 1], prompt[pos]
            entry = got[pos]
            assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-5)
            assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
            assert entry[str(token)]["decoded_token"] == TOK.decode([token], skip_special_tokens=False)
            top = row.topk(2).indices.tolist()
            assert {int(k) for k in entry} == set(top) | {token}
            assert [entry[str(t)]["rank"] for t in top] == [1, 2]


@BOTH_ENGINE_MODES
def test_echo_with_logprobs_through_the_openai_client(client, dense):
    prompt = "hello"
    ids = TOK.encode(prompt)  # <bos> h e l l o
    resp = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0)
    c = resp.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    out_ids = _ids(c.text[len(prompt) :])
    assert lp.tokens == [TOK.decode([t], skip_special_tokens=False) for t in ids + out_ids]
    ref = _dense_logprobs(dense, ids + out_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids) + len(out_ids)):
        token = (ids + out_ids)[pos]
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1][token]), abs=1e-5)
        top = {TOK.decode([t], skip_special_tokens=False) for t in ref[pos - 1].topk(2).indices.tolist()}
        assert set(lp.top_logprobs[pos]) == top | {lp.tokens[pos]}
    # offsets index the choice's text: <bos> takes no room, the output starts after the echoed prompt
    assert lp.text_offset[: len(ids) + 1] == [0, 0, 1, 2, 3, 4, 5]
    assert all(c.text[o : o + 1] == t for o, t in zip(lp.text_offset[1:], lp.tokens[1:]))
    assert math.isclose(sum(lp.token_logprobs[len(ids) :]), sum(lp.token_logprobs[-3:]))
    # streamed: the same text and logprobs, the echo and the prompt's logprobs in the first chunk
    text, tokens, token_lps = "", [], []
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0, stream=True
    ):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                token_lps += ch.logprobs.token_logprobs
    assert (text, tokens) == (c.text, lp.tokens)
    assert token_lps[0] is None and token_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


@BOTH_ENGINE_MODES
def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, client, dense):
    # the classic OpenAI scoring request (lm-eval style): the prompt back, with its logprobs, nothing generated
    prompts = ["12+34=46", "hello"]
    resp = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    assert resp.usage.completion_tokens == 0
    for prompt, c in zip(prompts, resp.choices):
        ids = TOK.encode(prompt)
        ref = _dense_logprobs(dense, ids)
        assert (c.text, c.finish_reason) == (prompt, "length")
        assert c.logprobs.tokens == [TOK.decode([t], skip_special_tokens=False) for t in ids]
        assert c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx([float(ref[p - 1][ids[p]]) for p in range(1, len(ids))])
    stream = client.completions.create(model=MODEL, prompt="hello", echo=True, logprobs=1, max_tokens=0, stream=True)
    chunks = [ch for chunk in stream for ch in chunk.choices]
    assert "".join(ch.text for ch in chunks) == "hello" and chunks[-1].finish_reason == "length"
    assert sum(len(ch.logprobs.tokens) for ch in chunks if ch.logprobs) == len(TOK.encode("hello"))
    r = _post(server, {"prompt": "ab", "max_tokens": 0})  # without echo there is nothing to return
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# ---- /health ----
def test_health_is_503_while_the_engine_has_work_and_makes_no_progress():
    engine = LLMEngine(_model(), TOK, EngineConfig(num_kv_blocks=32))
    real_step = engine.step
    stalled = threading.Event()
    stalled.set()

    def step(stream=True):
        if stalled.is_set():  # a scheduler that never schedules: the engine spins without progress
            time.sleep(0.01)
            return []
        return real_step(stream)

    engine.step = step
    limits = ServerLimits(health_stall_s=0.5)
    with BackgroundServer(OpenAIServer(engine, MODEL, limits=limits)) as bs:
        assert httpx.get(bs.url + "/health").status_code == 200  # idle, however long ago the last progress was
        result = {}
        worker = threading.Thread(
            target=lambda: result.update(r=_post(bs, {"prompt": "1+1=", "max_tokens": 3, "temperature": 0}))
        )
        worker.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not engine.has_unfinished_requests():
            time.sleep(0.02)
        assert httpx.get(bs.url + "/health").status_code == 200  # work, but not stalled for long yet
        time.sleep(0.7)
        r = httpx.get(bs.url + "/health")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_stalled" and "--health-stall-s 0.5" in err["message"]
        stalled.clear()  # the engine steps again: the request finishes and health recovers
        worker.join(30)
        assert result["r"].status_code == 200
        assert httpx.get(bs.url + "/health").json() == {"status": "ok"}


def test_sampling_params_checks_logit_bias_and_beam_processors():
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={3: float("nan")})
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(n=2, use_beam_search=True, min_p=0.1)
    engine = LLMEngine(_model(), TOK, EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("a", [5, 6], SamplingParams(logit_bias={100: 1.0}))
