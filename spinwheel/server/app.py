"""An OpenAI-compatible HTTP server on the engine (what ``vllm serve`` offers, for spinwheel checkpoints).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent
events ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus text format). Every error is an
OpenAI error object (``{"error": {"message", "type", "param", "code"}}``) with a 4xx status: bad input never takes
the server down. A client that disconnects aborts its requests, whose KV blocks are freed at the next step.

The rooms: ``middleware.py`` (body limit, API key), ``protocol.py`` (request bodies), ``params.py`` (request ->
``SamplingParams``), ``completions.py`` and ``chat.py`` (the endpoints), ``streaming.py`` (the SSE path both share),
``generation.py`` (one HTTP request fanned out to engine requests), ``async_engine.py`` (the engine's thread),
``metrics.py``. This module only wires them together.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from spinwheel.engine import LLMEngine
from spinwheel.server.async_engine import AsyncEngine, EngineDeadError
from spinwheel.server.chat import ChatCompletions
from spinwheel.server.completions import Completions
from spinwheel.server.metrics import ServerMetrics
from spinwheel.server.middleware import BodyLimitMiddleware, api_key_auth
from spinwheel.server.params import ServedModel
from spinwheel.server.protocol import APIError, ChatCompletionRequest, CompletionRequest


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
        self.async_engine = AsyncEngine(engine, on_step=self.metrics.observe_step)
        self.served = ServedModel(served_model_name, engine.model.config.vocab_size, engine.max_model_len)
        self.completions = Completions(self.served, self.tokenizer, self.async_engine)
        self.chat = ChatCompletions(self.served, self.tokenizer, self.async_engine)
        self.created = int(time.time())
        self.app = BodyLimitMiddleware(self._build_app(), max_body_bytes)

    def shutdown(self) -> None:
        self.async_engine.shutdown()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="spinwheel", docs_url=None, redoc_url=None, openapi_url=None)
        self._add_error_handlers(app)
        authorized = [Depends(api_key_auth(self.api_key))]

        @app.get("/health")
        async def health() -> Response:
            if not self.async_engine.alive:
                return JSONResponse({"status": "error", "error": repr(self.async_engine.error)}, status_code=503)
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models", dependencies=authorized)
        async def models() -> dict:
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created, "owned_by": "spinwheel",
                "max_model_len": self.engine.max_model_len}]}

        @app.post("/v1/completions", dependencies=authorized)
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self.completions(body, request)

        @app.post("/v1/chat/completions", dependencies=authorized)
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await self.chat(body, request)

        return app

    def _add_error_handlers(self, app: FastAPI) -> None:
        """Every failure becomes an OpenAI error object, counted by status in the metrics."""

        @app.exception_handler(APIError)
        async def _api_error(request: Request, e: APIError) -> JSONResponse:
            self.metrics.http_errors.labels(str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
            errors = e.errors()
            first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request"}
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
