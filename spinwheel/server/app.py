"""An OpenAI-compatible HTTP server on the engine (what ``vllm serve`` offers, for spinwheel checkpoints).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent
events ending in ``data: [DONE]``), ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` (as vLLM has them),
``GET /health``, ``GET /metrics`` (Prometheus text format). Every error is an OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``): bad input gets a 4xx and never takes the server down, and
anything unforeseen becomes a 500 error object, counted in the metrics. A client that disconnects aborts its
requests, whose KV blocks are freed at the next step.

The rooms: ``transport.py`` (connection limits under the HTTP parser), ``middleware.py`` (request body, API key),
``protocol.py`` (request bodies), ``params.py`` (request -> ``SamplingParams``), ``completions.py``, ``chat.py``
and ``tokenization.py`` (the endpoints), ``streaming.py`` (the SSE path both generation endpoints share),
``generation.py`` (one HTTP request fanned out to engine requests), ``async_engine.py`` (the engine on a thread) or
``engine_client.py`` (the engine in its own process), ``metrics.py``, ``limits.py``. This module only wires them
together.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import spinwheel
from spinwheel.engine import LLMEngine
from spinwheel.server.api.chat import ChatCompletions
from spinwheel.server.api.completions import Completions
from spinwheel.server.api.params import ServedModel
from spinwheel.server.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    internal_error,
)
from spinwheel.server.api.tokenization import Tokenization
from spinwheel.server.async_engine import AsyncEngine, EngineDeadError
from spinwheel.server.chat_template import ChatRenderer
from spinwheel.server.engine_client import EngineProcess
from spinwheel.server.limits import ServerLimits
from spinwheel.server.metrics import ServerMetrics
from spinwheel.server.middleware import RequestBodyMiddleware, api_key_auth, check_api_key, error_response
from spinwheel.server.transport import ConnectionGuard

logger = logging.getLogger(__name__)


class OpenAIServer:
    """The app on an engine: an :class:`LLMEngine` runs on a thread of this process (tests, notebooks, the RL loop),
    an :class:`EngineProcess` in a process of its own (``spinwheel serve``'s default)."""

    def __init__(
        self,
        engine: LLMEngine | EngineProcess,
        served_model_name: str,
        api_key: str | None = None,
        max_body_bytes: int = 1 << 20,
        limits: ServerLimits | None = None,
        special_tokens_in_content: bool = True,
    ) -> None:
        """``special_tokens_in_content``: a special token's text in a chat message becomes that token (vLLM's
        behaviour); False reads message content as text only (:mod:`~spinwheel.server.chat_template`)."""
        if engine.tokenizer is None:
            raise ValueError("the server needs an engine with a tokenizer")
        check_api_key(api_key)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.api_key = api_key
        self.limits = limits = limits or ServerLimits()
        self.metrics = ServerMetrics(engine)  # type: ignore[arg-type]  # both have stats()
        self.async_engine: AsyncEngine | EngineProcess
        if isinstance(engine, EngineProcess):
            engine.on_step = self.metrics.observe_step
            self.async_engine = engine
            vocab_size, loras = engine.vocab_size, engine.lora_names
        else:
            self.async_engine = AsyncEngine(engine, on_step=self.metrics.observe_step)
            vocab_size, loras = engine.model.config.vocab_size, tuple(engine.loras.names)
        if served_model_name in loras:
            raise ValueError(f"a LoRA adapter is named '{served_model_name}' like the served model: rename one")
        self.guard = ConnectionGuard(
            limits.max_connections,
            limits.header_timeout_s,
            limits.stall_timeout_s,
            limits.send_buffer_kb << 10,
            limits.max_header_kb << 10,
        )
        self.metrics.watch(
            lambda: self.async_engine.num_unread_outputs, lambda: (len(self.guard.open), self.guard.stats)
        )
        self.served = ServedModel(
            served_model_name,
            vocab_size,
            engine.max_model_len,
            limits.max_sequences_per_request,
            limits.max_logprobs_per_request,
            loras,
        )
        count = self.metrics.count_error
        renderer = ChatRenderer(self.tokenizer, special_tokens_in_content)
        self.completions = Completions(self.served, self.tokenizer, self.async_engine, count)
        self.chat = ChatCompletions(self.served, self.tokenizer, self.async_engine, count, renderer)
        self.tokenization = Tokenization(self.served, self.tokenizer, renderer)
        self.created = int(time.time())
        self.app = RequestBodyMiddleware(self._build_app(), max_body_bytes, limits.body_timeout_s, count)

    def shutdown(self) -> None:
        self.async_engine.shutdown()

    def uvicorn_config(self, host: str, port: int, log_level: str, http: str = "auto", loop: str = "auto") -> Any:
        """uvicorn's settings for this app: the ``http`` protocol (httptools or h11) under this server's connection
        guard, on the ``loop`` event loop (uvloop or asyncio; "auto" takes uvloop when it is installed)."""
        import uvicorn

        return uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level=log_level,
            http=self.guard.protocol_factory(http),
            loop=loop,
            h11_max_incomplete_event_size=2 * self.guard.max_header_bytes,  # the guard's 431 comes first
        )

    def _build_app(self) -> FastAPI:
        # No redirects: Starlette's slash redirect (`/v1/completions/` -> 307) is answered before authentication,
        # with a location built from the client's Host header. An unknown path is a 404 error object instead.
        app = FastAPI(title="spinwheel", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
        self._add_error_handlers(app)
        authorized = [Depends(api_key_auth(self.api_key))]

        @app.get("/health")
        async def health() -> Response:
            """200 while the engine serves; 503 with an error object when it has stopped (or is restarting), or
            when it has had work and made no progress for ``--health-stall-s`` (a scheduler stall, a hung step).
            Anyone may ask, so the answer names no process and no exception: the server log has them."""
            if not self.async_engine.alive:
                error = APIError(
                    503,
                    "the engine is not serving (it stopped, or is restarting); the server log says why",
                    type="server_error",
                    code="engine_stopped",
                )
                return JSONResponse({"status": "error", **error.body()}, status_code=503)
            stalled = self.async_engine.seconds_without_progress()
            if stalled > self.limits.health_stall_s:
                error = APIError(
                    503,
                    f"the engine has had unfinished requests for {stalled:.1f} s without producing a token or "
                    f"finishing a request (limit: --health-stall-s {self.limits.health_stall_s:g})",
                    type="server_error",
                    code="engine_stalled",
                )
                return JSONResponse({"status": "error", **error.body()}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/version")
        async def version() -> dict:
            return {"version": spinwheel.__version__}

        @app.get("/v1/models", dependencies=authorized)
        async def models() -> dict:
            """The base model, then each LoRA adapter with the base as its ``parent`` (as vLLM lists them)."""
            card = {"object": "model", "created": self.created, "owned_by": "spinwheel"}
            card["max_model_len"] = self.engine.max_model_len
            adapters = [{"id": name, **card, "parent": self.model_name} for name in self.served.loras]
            return {"object": "list", "data": [{"id": self.model_name, **card}, *adapters]}

        @app.post("/v1/completions", dependencies=authorized)
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self.completions(body, request)

        @app.post("/v1/chat/completions", dependencies=authorized)
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await self.chat(body, request)

        @app.post("/tokenize", dependencies=authorized)
        async def tokenize(body: TokenizeRequest) -> dict:
            return await self.tokenization.tokenize(body)

        @app.post("/detokenize", dependencies=authorized)
        async def detokenize(body: DetokenizeRequest) -> dict:
            return await self.tokenization.detokenize(body)

        return app

    def _add_error_handlers(self, app: FastAPI) -> None:
        """Every failure becomes an OpenAI error object, counted by status in the metrics."""

        @app.exception_handler(APIError)
        async def _api_error(request: Request, e: APIError) -> Response:
            self.metrics.count_error(e.status)
            return error_response(e)

        @app.exception_handler(RequestValidationError)
        async def _validation_error(request: Request, e: RequestValidationError) -> Response:
            errors = e.errors()
            first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request"}
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            if first.get("type") == "json_invalid":
                message, param = f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
            elif not loc and "json" not in (ctype := request.headers.get("content-type", "")):  # curl -d alone
                message, param = f"send the body as JSON with Content-Type: application/json (got {ctype!r})", None
            elif first.get("type") == "invalid_unicode":
                message, param = str(first.get("msg")), first["ctx"]["param"]
            else:
                param = ".".join(loc) or None
                message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
            return await _api_error(request, APIError(400, message, param=param))

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
            return await _api_error(
                request,
                APIError(
                    e.status_code,
                    str(e.detail),
                    type="not_found_error" if e.status_code == 404 else "invalid_request_error",
                ),
            )

        @app.exception_handler(EngineDeadError)
        async def _engine_dead(request: Request, e: EngineDeadError) -> Response:
            return await _api_error(request, APIError(503, str(e), type="server_error"))

        @app.exception_handler(Exception)
        async def _unexpected(request: Request, e: Exception) -> Response:
            # Starlette re-raises after answering, so uvicorn logs the traceback (rate-limited by serve's filter).
            return await _api_error(request, internal_error(e))
