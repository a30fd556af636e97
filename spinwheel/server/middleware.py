"""What every request passes before a route sees it: the request body read whole under a size limit and a
deadline (an ASGI middleware around the app), and the API-key check (a FastAPI dependency)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from spinwheel.server.api.protocol import APIError


class RequestBodyMiddleware:
    """Read each request body in full before the app runs: 413 above ``max_bytes`` (announced by Content-Length
    or counted while a chunked body streams in), 408 when the whole body has not arrived within ``timeout_s``.
    The app then reads the buffered body; later ``receive`` calls (disconnect detection) go to the server.
    ``on_error(status)`` counts the answers given here."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float, on_error: Callable[[int], None]) -> None:
        self.app, self.max_bytes, self.timeout_s, self.on_error = app, max_bytes, timeout_s, on_error

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._answer(send, too_large)
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                await self._answer(
                    send,
                    APIError(408, f"request body not received within {self.timeout_s:g} s", code="request_timeout"),
                )
                return
            if message["type"] != "http.request":
                return  # the client went away before its body was complete: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._answer(send, too_large)
                return
            if not message.get("more_body", False):
                break
        replay: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def buffered_receive() -> dict:
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()

        await self.app(scope, buffered_receive, send)

    async def _answer(self, send: Any, error: APIError) -> None:
        self.on_error(error.status)
        body = error_json(error)
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def error_json(error: APIError) -> bytes:
    """The error object as JSON; ASCII-escaped, so that any text a message quotes (even a lone surrogate) encodes."""
    return json.dumps(error.body(), ensure_ascii=True).encode()


def error_response(error: APIError) -> Response:
    return Response(error_json(error), status_code=error.status, media_type="application/json")


def check_api_key(api_key: str | None) -> None:
    """An API key travels in an HTTP header: printable ASCII without spaces, or no client could ever send it."""
    if api_key is not None and (not api_key or not all(33 <= ord(ch) <= 126 for ch in api_key)):
        raise ValueError(
            "the API key must be non-empty printable ASCII without spaces (it is sent in the "
            "'Authorization: Bearer <key>' header); choose another --api-key / $SPINWHEEL_API_KEY"
        )


def api_key_auth(api_key: str | None) -> Callable[[Request], Coroutine[Any, Any, None]]:
    """A dependency that accepts ``Authorization: Bearer <api_key>`` (anything when ``api_key`` is None). The
    comparison is on bytes, in constant time, so any header (non-ASCII included) gets a 401 rather than a 500."""
    check_api_key(api_key)
    expected = None if api_key is None else api_key.encode("ascii")

    async def authorize(request: Request) -> None:
        if expected is None:
            return
        header = dict(request.scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), expected):
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                type="authentication_error",
                code="invalid_api_key",
            )

    return authorize
