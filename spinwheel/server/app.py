"""An OpenAI-compatible HTTP server on the engine (what ``vllm serve`` offers, for spinwheel checkpoints).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent
events ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus text format). Every error is an
OpenAI error object (``{"error": {"message", "type", "param", "code"}}``) with a 4xx status: bad input never takes
the server down. A client that disconnects aborts its requests, whose KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from spinwheel.engine import CompletionOutput, LLMEngine, RequestOutput, SamplingParams
from spinwheel.models.tokenizer import TokenizerError
from spinwheel.server.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from spinwheel.server.metrics import ServerMetrics
from spinwheel.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# transport: body-size limit and authentication
# ---------------------------------------------------------------------------------------------------------------

class BodyLimitMiddleware:
    """Answer 413 to bodies over ``max_bytes``, by Content-Length or while a chunked body streams in."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _send_error(send, APIError(413, f"request body exceeds {self.max_bytes} bytes",
                                             code="request_too_large"))
            return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except APIError as e:
            await _send_error(send, e)


async def _send_error(send: Any, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class _Choice:
    """Streaming bookkeeping for one output: how much text and how many tokens were already sent."""

    sent_chars: int = 0
    sent_tokens: int = 0
    started: bool = False
    finished: bool = False


class OpenAIServer:
    def __init__(self, engine: LLMEngine, served_model_name: str, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20) -> None:
        if engine.tokenizer is None:
            raise ValueError("the server needs an engine with a tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.api_key = api_key
        self.metrics = ServerMetrics(engine)
        self._last_token_time: dict[str, tuple[float, int]] = {}
        self.async_engine = AsyncEngine(engine, on_step=self._observe_step)
        self.created = int(time.time())
        self.app = self._build_app(max_body_bytes)

    def shutdown(self) -> None:
        self.async_engine.shutdown()

    # ---- metrics, from the engine thread ----
    def _observe_step(self, outputs: list[RequestOutput], step_s: float) -> None:
        self.metrics.step_time.observe(step_s)
        now = time.monotonic()
        for out in outputs:
            num = sum(len(o.token_ids) for o in out.outputs)
            last = self._last_token_time.get(out.request_id)
            if num and (last is None or num > last[1]):
                if last is not None:
                    self.metrics.itl.observe(now - last[0])
                elif "first_token_time" in out.metrics:
                    self.metrics.ttft.observe(out.metrics["first_token_time"] - out.metrics["arrival_time"])
                self._last_token_time[out.request_id] = (now, num)
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason if out.outputs else ("error" if out.error else "abort")
                self.metrics.requests.labels(reason or "abort").inc()
                self.metrics.e2e.observe(out.metrics.get("finish_time", now) - out.metrics["arrival_time"])

    # ---- app ----
    def _build_app(self, max_body_bytes: int) -> Any:
        app = FastAPI(title="spinwheel", docs_url=None, redoc_url=None, openapi_url=None)

        async def authorize(request: Request) -> None:
            if self.api_key is None:
                return
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self.api_key):
                raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               type="authentication_error", code="invalid_api_key")

        @app.exception_handler(APIError)
        async def _api_error(request: Request, e: APIError) -> JSONResponse:
            self.metrics.http_errors.labels(str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
            errors = e.errors()
            first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            if first.get("type") == "json_invalid":
                message, param = f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
            else:
                param = ".".join(loc) or None
                message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
            return await _api_error(request, APIError(400, message, param=param))

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
            return await _api_error(request, APIError(e.status_code, str(e.detail),
                                                      type="not_found_error" if e.status_code == 404
                                                      else "invalid_request_error"))

        @app.exception_handler(EngineDeadError)
        async def _engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
            return JSONResponse(APIError(503, str(e), type="server_error").body(), status_code=503)

        @app.get("/health")
        async def health() -> Response:
            if not self.async_engine.alive:
                return JSONResponse({"status": "error", "error": repr(self.async_engine.error)}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models", dependencies=[Depends(authorize)])
        async def models() -> dict:
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created, "owned_by": "spinwheel",
                "max_model_len": self.engine.max_model_len}]}

        @app.post("/v1/completions", dependencies=[Depends(authorize)])
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._completions(body, request)

        @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._chat(body, request)

        return BodyLimitMiddleware(app, max_body_bytes)

    # ---- request preparation ----
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           type="not_found_error", param="model", code="model_not_found")

    def _check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """Validate token ids and context length; returns the effective max_tokens."""
        vocab = self.engine.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise APIError(400, f"the prompt has {len(ids)} tokens, but this model's context length is {limit} "
                                f"tokens (prompt plus at least one generated token must fit)", param=param,
                           code="context_length_exceeded")
        if max_tokens is None:
            return limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but {len(ids)} prompt "
                                f"tokens plus max_tokens={max_tokens} makes {len(ids) + max_tokens}; lower "
                                f"max_tokens or shorten the prompt", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def _params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                logprobs: int | None) -> SamplingParams:
        vocab = self.engine.model.config.vocab_size
        bad = next((t for t in body.stop_token_ids or [] if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"stop token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="stop_token_ids")
        try:
            return SamplingParams(
                n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=min(max(0, body.top_k), vocab),
                min_p=body.min_p, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids or [],
                max_tokens=max_tokens, min_tokens=min(body.min_tokens, max_tokens), ignore_eos=body.ignore_eos,
                logprobs=logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # ---- running requests ----
    async def _run(self, request_id: str, prompts: list[list[int]], params: SamplingParams
                   ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run one engine request per prompt concurrently; yield (prompt index, cumulative output) as they come.
        Leaving early aborts every unfinished request."""
        queue: asyncio.Queue = asyncio.Queue()
        done: set[int] = set()

        async def pump(i: int) -> None:
            try:
                async for out in self.async_engine.generate(f"{request_id}-{i}", prompts[i], params):
                    await queue.put((i, out))
            except BaseException as e:
                await queue.put((i, e))
                raise

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompts))]
        try:
            while len(done) < len(prompts):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    if isinstance(item, ValueError):
                        raise APIError(400, str(item))
                    if isinstance(item, EngineDeadError):
                        raise APIError(503, str(item), type="server_error")
                    if isinstance(item, EngineStepError):
                        raise APIError(500, str(item), type="server_error")
                    raise item
                if item.finished:
                    done.add(i)
                    if item.error:
                        raise APIError(400, item.error)
                yield i, item
        finally:
            for i, t in enumerate(tasks):
                if not t.done():
                    t.cancel()
                if i not in done:
                    self.async_engine.abort(f"{request_id}-{i}")

    async def _collect(self, request: Request, request_id: str, prompts: list[list[int]], params: SamplingParams
                       ) -> list[RequestOutput]:
        """Final outputs of every prompt; a client that goes away meanwhile aborts them."""
        final: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for i, out in self._run(request_id, prompts, params):
                if out.finished:
                    final[i] = out

        task = asyncio.ensure_future(consume())
        while True:
            finished, _ = await asyncio.wait({task}, timeout=0.5)
            if finished:
                task.result()
                return [final[i] for i in range(len(prompts))]
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")

    # ---- /v1/completions ----
    async def _completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        raw = body.prompt
        if isinstance(raw, str):
            texts: list[str | None] = [raw]
            prompts = [self.tokenizer.encode(raw)]
        elif isinstance(raw[0], str):
            texts, prompts = list(raw), self.tokenizer.encode_batch(list(raw))  # type: ignore[arg-type]
        elif isinstance(raw[0], int):
            texts, prompts = [None], [list(raw)]  # type: ignore[list-item]
        else:
            texts, prompts = [None] * len(raw), [list(p) for p in raw]  # type: ignore[union-attr]
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        for ids in prompts:
            self._check_prompt(ids, max_tokens, "prompt")
        params = self._params(body, max_tokens, body.logprobs)
        rid = f"cmpl-{secrets.token_hex(12)}"
        created = int(time.time())
        n = body.n

        def prefix(i: int) -> str:
            if not body.echo:
                return ""
            return texts[i] if texts[i] is not None else self.tokenizer.decode(prompts[i])  # type: ignore

        def choice(i: int, c: CompletionOutput, text: str, start_token: int, start_char: int,
                   finish: str | None) -> dict:
            lp = None
            if body.logprobs is not None and c.logprobs is not None:
                lp = self._completion_logprobs(c.token_ids[start_token:], c.logprobs[start_token:], start_char)
            return {"index": i * n + c.index, "text": text, "logprobs": lp, "finish_reason": finish}

        if not body.stream:
            outs = await self._collect(request, rid, prompts, params)
            choices = [choice(i, c, prefix(i) + c.text, 0, len(prefix(i)), c.finish_reason)
                       for i, out in enumerate(outs) for c in out.outputs]
            choices.sort(key=lambda ch: ch["index"])
            return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                                 "model": self.model_name, "choices": choices,
                                 "usage": _usage(prompts, outs)})

        async def events() -> AsyncIterator[str]:
            state: dict[tuple[int, int], _Choice] = {}
            completion_tokens = 0
            try:
                async for i, out in self._run(rid, prompts, params):
                    for c in out.outputs:
                        st = state.setdefault((i, c.index), _Choice())
                        text = ""
                        if not st.started and body.echo:
                            text = prefix(i)
                        st.started = True
                        delta, end = _delta(c, st, params)
                        finish = c.finish_reason if c.finished and not st.finished else None
                        if not delta and not text and finish is None and c.logprobs is None:
                            continue
                        ch = choice(i, c, text + delta, st.sent_tokens, st.sent_chars, finish)
                        st.sent_chars, st.sent_tokens = end, len(c.token_ids)
                        st.finished = st.finished or c.finished
                        if c.finished and finish is not None:
                            completion_tokens += len(c.token_ids)
                        yield _sse({"id": rid, "object": "text_completion", "created": created,
                                    "model": self.model_name, "choices": [ch]})
                if body.stream_options and body.stream_options.include_usage:
                    prompt_tokens = sum(len(p) for p in prompts)
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                                "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                         "completion_tokens": completion_tokens,
                                                         "total_tokens": prompt_tokens + completion_tokens}})
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, lp in zip(token_ids, logprobs):
            s = self._token_text(t)
            tokens.append(s)
            token_lps.append(lp.get(t))
            tops.append({self._token_text(k): v for k, v in sorted(lp.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    # ---- /v1/chat/completions ----
    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
        content = []
        for t, lp in zip(token_ids, logprobs):
            s = self._token_text(t)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            content.append({"token": s, "logprob": lp.get(t), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self._token_text(i), "logprob": v,
                                              "bytes": list(self._token_text(i).encode())} for i, v in top]})
        return {"content": content}

    async def _chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except TokenizerError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template writes special tokens
        max_tokens = self._check_prompt(ids, body.max_completion_tokens or body.max_tokens, "messages")
        want_lp = body.logprobs
        top_k = body.top_logprobs or 0
        if top_k and not want_lp:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        params = self._params(body, max_tokens, top_k if want_lp else None)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        created = int(time.time())

        if not body.stream:
            (out,) = await self._collect(request, rid, [ids], params)
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, top_k)
                        if want_lp and c.logprobs is not None else None,
                        "finish_reason": c.finish_reason} for c in out.outputs]
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                                 "model": self.model_name, "choices": choices, "usage": _usage([ids], [out])})

        def chunk(choices: list[dict], **extra: Any) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                         "choices": choices, **extra})

        async def events() -> AsyncIterator[str]:
            state: dict[int, _Choice] = {}
            completion_tokens = 0
            try:
                async for _, out in self._run(rid, [ids], params):
                    for c in out.outputs:
                        st = state.setdefault(c.index, _Choice())
                        if not st.started:
                            st.started = True
                            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])
                        delta, end = _delta(c, st, params)
                        finish = c.finish_reason if c.finished and not st.finished else None
                        new_tokens = c.token_ids[st.sent_tokens:]
                        if not delta and finish is None and not (want_lp and new_tokens):
                            continue
                        lp = (self._chat_logprobs(new_tokens, c.logprobs[st.sent_tokens:], top_k)
                              if want_lp and c.logprobs is not None else None)
                        st.sent_chars, st.sent_tokens = end, len(c.token_ids)
                        st.finished = st.finished or c.finished
                        if finish is not None:
                            completion_tokens += len(c.token_ids)
                        yield chunk([{"index": c.index, "delta": {"content": delta} if delta else {},
                                      "logprobs": lp, "finish_reason": finish}])
                if body.stream_options and body.stream_options.include_usage:
                    yield chunk([], usage={"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                                           "total_tokens": len(ids) + completion_tokens})
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _usage(prompts: list[list[int]], outs: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _delta(c: CompletionOutput, st: _Choice, params: SamplingParams) -> tuple[str, int]:
    """New text of an output since the last chunk, and the new sent position. While the output runs, the last
    characters that could still turn out to start a stop string (or an incomplete UTF-8 character) are held back
    so that text once sent is never taken back."""
    end = len(c.text)
    if not c.finished:
        hold = max((len(s) for s in params.stop or []), default=1) - 1
        end = max(st.sent_chars, end - hold)
        while end > st.sent_chars and c.text[end - 1] == "\ufffd":
            end -= 1
    return c.text[st.sent_chars:end], end


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
