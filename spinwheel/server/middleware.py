"""What every request passes before a route sees it: the body-size limit (an ASGI middleware around the app) and
the API-key check (a FastAPI dependency on the ``/v1`` routes)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.requests import Request

from spinwheel.server.protocol import APIError


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
            await send_error(send, APIError(413, f"request body exceeds {self.max_bytes} bytes",
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
            await send_error(send, e)


async def send_error(send: Any, error: APIError) -> None:
    """Answer with an OpenAI error object directly over ASGI (outside the FastAPI app)."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def api_key_auth(api_key: str | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    """A dependency that accepts ``Authorization: Bearer <api_key>`` (anything when ``api_key`` is None)."""

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")

    return authorize
