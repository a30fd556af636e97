"""Connection-level defences under uvicorn's HTTP/1.1 protocols (httptools, the default, or h11): a header
timeout, a cap on a request head's size, a cap on open connections, and a write-stall timeout. These cannot live in
the ASGI app: it is called only once a request's headers are complete, so a client that never finishes them
(slowloris) is invisible to it.

- **Header timeout.** From connecting, and again from the end of each response (keep-alive), a connection has
  ``header_timeout_s`` to deliver a complete request head; otherwise it is answered 408 and closed.
- **Header size.** A request head still unfinished after ``max_header_bytes`` is answered 431 and closed
  (httptools itself buffers headers without a bound; h11 is set to stop at twice that, after the guard).
- **Connection cap.** At ``max_connections`` open connections, a new one replaces the connection that has waited
  longest for its request head (a slowloris or an idle keep-alive one); when every connection is busy with a
  request, the new one is answered 503 and closed at once. Descriptors stay bounded by the cap either way.
- **Write stall.** A connection whose client leaves written data unread (the transport's buffer above its high
  mark) for ``stall_timeout_s`` is aborted; the app sees a disconnect, so the request's engine work is aborted
  and its KV blocks freed. The kernel's send buffer is set to ``send_buffer_bytes`` (the OS would grow it to
  MBs per connection), so that a client that stops reading is noticed soon and pins little memory meanwhile.

``http="auto"`` takes httptools (a C parser, as uvicorn's own "auto" does) when it is installed, else h11.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def _reply(status: str, text: str) -> bytes:
    """A whole plain-text response that closes the connection (written before or instead of the app)."""
    body = text.encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode() + body


_REFUSED = _reply("503 Service Unavailable", "too many open connections")
_HEADER_TIMEOUT = _reply("408 Request Timeout", "request headers not received in time")
_HEADER_TOO_LARGE = _reply("431 Request Header Fields Too Large", "request headers are too large")


def _resolve(flag: str, choice: str, fast: str, plain: str) -> str:
    """``fast`` or ``plain`` for a ``--flag`` of ``auto`` / ``fast`` / ``plain``, as uvicorn's "auto" picks: the fast
    implementation when its package is installed (ValueError when it is asked for by name and is not)."""
    if choice not in ("auto", fast, plain):
        raise ValueError(f"--{flag} must be one of auto, {fast}, {plain}, got {choice!r}")
    if choice == plain:
        return plain
    if importlib.util.find_spec(fast) is None:
        if choice == fast:
            raise ValueError(f"--{flag} {fast}: the {fast} package is not installed (pip install {fast})")
        return plain
    return fast


def resolve_http(http: str) -> str:
    """``"httptools"`` or ``"h11"`` for a ``--http`` choice."""
    return _resolve("http", http, "httptools", "h11")


def resolve_loop(loop: str) -> str:
    """``"uvloop"`` or ``"asyncio"`` for a ``--loop`` choice."""
    return _resolve("loop", loop, "uvloop", "asyncio")


@dataclass
class ConnectionStats:
    """Counters of what the guard did, since the server started."""

    num_refused: int = 0
    num_evicted: int = 0
    num_header_timeouts: int = 0
    num_write_stalls: int = 0
    num_headers_too_large: int = 0


class ConnectionGuard:
    """The connections of one server: which are open, and which wait for a request head (oldest first)."""

    def __init__(
        self,
        max_connections: int,
        header_timeout_s: float,
        stall_timeout_s: float,
        send_buffer_bytes: int = 0,
        max_header_bytes: int = 64 << 10,
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s, self.stall_timeout_s = header_timeout_s, stall_timeout_s
        self.send_buffer_bytes, self.max_header_bytes = send_buffer_bytes, max_header_bytes
        self.open: set[_Guarded] = set()
        self.waiting: dict[_Guarded, None] = {}  # insertion order = waiting since
        self.stats = ConnectionStats()

    def admit(self, conn: _Guarded) -> bool:
        if len(self.open) >= self.max_connections:
            if not self.waiting:
                self.stats.num_refused += 1
                return False
            oldest = next(iter(self.waiting))
            self.stats.num_evicted += 1
            oldest.drop()
        self.open.add(conn)
        return True

    def release(self, conn: _Guarded) -> None:
        self.open.discard(conn)
        self.waiting.pop(conn, None)

    def protocol_factory(self, http: str = "auto") -> Any:
        """What ``uvicorn.Config(http=...)`` takes: the protocol class of ``http`` bound to this guard."""
        if resolve_http(http) == "httptools":
            return functools.partial(GuardedHttpToolsProtocol, guard=self)
        return functools.partial(GuardedH11Protocol, guard=self)


class _Guarded:
    """The guard's side of one of uvicorn's HTTP protocols (mixed in before it). It relies on ``cycle`` (the
    current request-response cycle, replaced when a request head has been parsed) as uvicorn's protocols define
    it: a head has arrived when the cycle is new, or is one whose response has not completed (a pipelined one)."""

    guard: ConnectionGuard
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes received since waiting for a head began, while none is complete
        self._cycle_before: Any = None
        self._stall_timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.Transport) -> None:
        if not self.guard.admit(self):
            self._refused = True
            transport.write(_REFUSED)
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if self.guard.send_buffer_bytes and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.guard.send_buffer_bytes)
        super().connection_made(transport)  # type: ignore[misc]
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self._head_timer is None or self._check_head():
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.guard.max_header_bytes and not self.transport.is_closing():
            self._cancel_timers()
            self.guard.waiting.pop(self, None)
            self.guard.stats.num_headers_too_large += 1
            self.transport.write(_HEADER_TOO_LARGE)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_timers()
        self.guard.release(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.guard.stall_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    # ---- uvicorn ----
    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_head()  # before pipelined requests are started, so that their cycle counts as new
        super().on_response_complete()  # type: ignore[misc]
        self._check_head()

    # ---- the guard's side ----
    def drop(self) -> None:
        """Close at once (the guard needs the place for a new connection)."""
        self.guard.release(self)
        self.transport.abort()

    def _partial_head(self) -> bool:
        """Part of a request head has arrived (else the connection is an idle keep-alive one)."""
        return self._head_bytes > 0

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._cycle_before, self._head_bytes = self.cycle, 0
        self._head_timer = self.loop.call_later(self.guard.header_timeout_s, self._head_timed_out)
        self.guard.waiting.pop(self, None)
        self.guard.waiting[self] = None

    def _check_head(self) -> bool:
        """Stop the header timer if a head has arrived; whether one has."""
        cycle = self.cycle
        arrived = cycle is not None and (cycle is not self._cycle_before or not cycle.response_complete)
        if self._head_timer is not None and arrived:
            self._head_timer.cancel()
            self._head_timer = None
            self.guard.waiting.pop(self, None)
        return arrived

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.guard.waiting.pop(self, None)
        if not self.transport.is_closing():
            self.guard.stats.num_header_timeouts += 1
            if self._partial_head():  # say why; an idle keep-alive connection just closes
                self.transport.write(_HEADER_TIMEOUT)
            self.transport.close()

    def _write_stalled(self) -> None:
        self._stall_timer = None
        if not self.transport.is_closing():
            self.guard.stats.num_write_stalls += 1
            logger.warning(
                "a client left its response unread for %g s; closing its connection", self.guard.stall_timeout_s
            )
            self.transport.abort()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._stall_timer = None


class GuardedH11Protocol(_Guarded, H11Protocol):
    """uvicorn's h11 protocol (pure Python), watched by a :class:`ConnectionGuard`."""

    def _partial_head(self) -> bool:
        return bool(self.conn.trailing_data[0]) or super()._partial_head()


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: h11 only
    pass
else:

    class GuardedHttpToolsProtocol(_Guarded, HttpToolsProtocol):
        """uvicorn's httptools protocol (a C parser), watched by a :class:`ConnectionGuard`."""

        _in_head = False  # the parser has begun a request whose head is not complete (bytes held in the parser)

        def on_message_begin(self) -> None:
            self._in_head = True
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def _partial_head(self) -> bool:
            return self._in_head or super()._partial_head()
