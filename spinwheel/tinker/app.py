"""The Tinker HTTP API (the routes the ``tinker`` SDK 0.38 calls, under ``/api/v1``) as a FastAPI app.

Requests that touch the model answer ``{"request_id": ...}`` at once (an ``UntypedAPIFuture``) and the client polls
``retrieve_future``; metadata requests (sessions, capabilities, ``get_info``, sampling sessions) answer directly.
``client/config`` tells the SDK which of its optional paths to use: no JWT exchange (any ``tml-`` key is accepted),
forward_backward chunks sent one after another, uncompressed. A request's own fault that is found before it is
queued (an undecodable body, an unknown loss) still becomes a failed future, so the SDK raises its
``RequestFailedError`` for it rather than retrying a 4xx.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from spinwheel.tinker.ops import TinkerService
from spinwheel.tinker.service import fail
from spinwheel.tinker.wire import decode_forward_backward

PROTOBUF = "application/x-protobuf"
POLL_SECONDS = 30.0  # how long one retrieve_future waits before answering try_again (the SDK waits 45 s)

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "fwdbwd_max_chunk_len": 1 << 20,
    "fwdbwd_max_chunk_bytes_count": 1 << 40,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def _future(rid: str, model_id: str | None = None) -> dict:
    return {"request_id": rid, "model_id": model_id}


def _failed_now(svc: TinkerService, e: Exception, model_id: str | None = None) -> dict:
    rid = svc.store.create()
    fail(svc.store, rid, e)
    return _future(rid, model_id)


def session_routes(app: FastAPI, svc: TinkerService) -> None:
    @app.get("/api/v1/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    def client_config(body: dict) -> dict:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    def dynamic_config(body: dict) -> dict:
        return {}

    @app.post("/api/v1/create_session")
    def create_session(body: dict) -> dict:
        return {"type": "create_session", "session_id": svc.create_session()}

    @app.post("/api/v1/session_heartbeat")
    def heartbeat(body: dict) -> dict:
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    def finish(session_id: str, body: dict) -> dict:
        return {}

    @app.post("/api/v1/telemetry")
    def telemetry(body: dict) -> dict:
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    def capabilities() -> dict:
        return svc.capabilities()

    @app.post("/api/v1/get_info")
    def get_info(body: dict) -> Any:
        try:
            return svc.info(body["model_id"])
        except LookupError as e:
            return JSONResponse({"detail": str(e)}, status_code=404)

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(body: dict) -> Any:
        rid = body.get("request_id", "")
        if not svc.store.known(rid):
            return JSONResponse({"detail": f"no request '{rid}' (finished long ago, or never sent)"}, 404)
        deadline = asyncio.get_running_loop().time() + POLL_SECONDS
        delay = 0.002
        while (outcome := svc.store.poll(rid, 0)) is None:
            if asyncio.get_running_loop().time() > deadline:
                return {"type": "try_again", "request_id": rid, "queue_state": "active"}
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        if outcome.error is not None:
            return {"error": outcome.error, "category": outcome.category}
        if isinstance(outcome.value, bytes):
            return Response(outcome.value, media_type=PROTOBUF)
        return outcome.value


def training_routes(app: FastAPI, svc: TinkerService) -> None:
    @app.post("/api/v1/create_model")
    def create_model(body: dict) -> dict:
        try:
            rid = svc.create_model(
                body["session_id"],
                int(body["model_seq_id"]),
                body.get("base_model"),
                body.get("lora_config") or {},
                (body.get("lora_config") or {}).get("seed"),
            )
            return _future(rid)
        except Exception as e:
            return _failed_now(svc, e)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        body = await request.body()
        try:
            req = decode_forward_backward(body, request.headers.get("content-encoding"))
        except Exception as e:
            return _failed_now(svc, e)
        return _future(svc.forward_backward(req), req.model_id)

    @app.post("/api/v1/optim_step")
    def optim_step(body: dict) -> dict:
        params = body.get("adam_params") or body.get("optimizer_params") or body.get("optim_params") or {}
        try:
            return _future(svc.optim_step(body["model_id"], params), body["model_id"])
        except Exception as e:
            return _failed_now(svc, e, body.get("model_id"))

    @app.post("/api/v1/save_weights")
    def save_weights(body: dict) -> dict:
        rid = svc.save(body["model_id"], body.get("path") or f"state-{body.get('seq_id', 0)}", "weights", True)
        return _future(rid, body["model_id"])

    @app.post("/api/v1/save_weights_for_sampler")
    def save_weights_for_sampler(body: dict) -> dict:
        return _future(svc.save(body["model_id"], body.get("path"), "sampler_weights", False), body["model_id"])

    @app.post("/api/v1/load_weights")
    def load_weights(body: dict) -> dict:
        create = None
        model_id = body.get("model_id")
        if model_id is None:  # create-via-load: a new client from saved state
            model_id = f"{body['session_id']}:train:{int(body['model_seq_id'])}"
            create = (body.get("base_model"), None)
        return _future(svc.load(model_id, body["path"], bool(body.get("optimizer")), create), model_id)


def sampling_routes(app: FastAPI, svc: TinkerService) -> None:
    @app.post("/api/v1/create_sampling_session")
    def create_sampling_session(body: dict) -> Any:
        try:
            sid = svc.create_sampling_session(body["session_id"], body.get("model_path"), body.get("base_model"))
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=404)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get("/api/v1/samplers/{sampler_id}")
    def sampler(sampler_id: str) -> Any:
        try:
            return svc.sampler_info(sampler_id)
        except ValueError as e:
            return JSONResponse({"detail": str(e)}, status_code=404)

    @app.post("/api/v1/asample")
    def asample(body: dict) -> dict:
        rid = svc.sample(body.get("sampling_session_id") or "", body)
        num = body.get("num_samples", 1)
        ids = [f"{rid}:{i}" for i in range(num if isinstance(num, int) and 0 < num <= 1 << 16 else 1)]
        return {**_future(rid), "sample_sequence_ids": ids}


def build_app(svc: TinkerService) -> FastAPI:
    app = FastAPI(title="spinwheel tinker", docs_url=None, redoc_url=None)
    session_routes(app, svc)
    training_routes(app, svc)
    sampling_routes(app, svc)
    return app
