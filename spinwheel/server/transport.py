"""Connection-level defences under uvicorn's HTTP/1.1 protocol (h11): a header timeout, a cap on open
connections, and a write-stall timeout. These cannot live in the ASGI app: it is called only once a request's
headers are complete, so a client that never finishes them (slowloris) is invisible to it.

- **Header timeout.** From connecting, and again from the end of each response (keep-alive), a connection has
  ``header_timeout_s`` to deliver a complete request head; otherwise it is answered 408 and closed.
- **Connection cap.** At ``max_connections`` open connections, a new one replaces the connection that has waited
  longest for its request head (a slowloris or an idle keep-alive one); when every connection is busy with a
  request, the new one is answered 503 and closed at once. Descriptors stay bounded by the cap either way.
- **Write stall.** A connection whose client leaves written data unread (the transport's buffer above its high
  mark) for ``stall_timeout_s`` is aborted; the app sees a disconnect, so the request's engine work is aborted
  and its KV blocks freed. The kernel's send buffer is set to ``send_buffer_bytes`` (the OS would grow it to
  MBs per connection), so that a client that stops reading is noticed soon and pins little memory meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 24\r\n"
    b"connection: close\r\n\r\ntoo many open connections"
)
_HEADER_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 36\r\n"
    b"connection: close\r\n\r\nrequest headers not received in time"
)


@dataclass
class ConnectionStats:
    """Counters of what the guard did, since the server started."""

    num_refused: int = 0
    num_evicted: int = 0
    num_header_timeouts: int = 0
    num_write_stalls: int = 0


class ConnectionGuard:
    """The connections of one server: which are open, and which wait for a request head (oldest first)."""

    def __init__(
        self, max_connections: int, header_timeout_s: float, stall_timeout_s: float, send_buffer_bytes: int = 0
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s, self.stall_timeout_s = header_timeout_s, stall_timeout_s
        self.send_buffer_bytes = send_buffer_bytes
        self.open: set[GuardedH11Protocol] = set()
        self.waiting: dict[GuardedH11Protocol, None] = {}  # insertion order = waiting since
        self.stats = ConnectionStats()

    def admit(self, conn: GuardedH11Protocol) -> bool:
        if len(self.open) >= self.max_connections:
            if not self.waiting:
                self.stats.num_refused += 1
                return False
            oldest = next(iter(self.waiting))
            self.stats.num_evicted += 1
            oldest.drop()
        self.open.add(conn)
        return True

    def release(self, conn: GuardedH11Protocol) -> None:
        self.open.discard(conn)
        self.waiting.pop(conn, None)

    def protocol_factory(self) -> Any:
        """What ``uvicorn.Config(http=...)`` takes: the protocol class bound to this guard."""
        return functools.partial(GuardedH11Protocol, guard=self)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, watched by a :class:`ConnectionGuard`. It relies on ``cycle`` (the current
    request-response cycle, replaced when a request head has been parsed) as uvicorn's protocols define it."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._cycle_before: Any = None
        self._stall_timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self.guard.admit(self):
            self._refused = True
            transport.write(_REFUSED)
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if self.guard.send_buffer_bytes and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.guard.send_buffer_bytes)
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_timers()
        self.guard.release(self)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.guard.stall_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    # ---- uvicorn ----
    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_head()  # before pipelined requests are parsed, so that their cycle counts as new
        super().on_response_complete()
        self._check_head()

    # ---- the guard's side ----
    def drop(self) -> None:
        """Close at once (the guard needs the place for a new connection)."""
        self.guard.release(self)
        self.transport.abort()

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._cycle_before = self.cycle
        self._head_timer = self.loop.call_later(self.guard.header_timeout_s, self._head_timed_out)
        self.guard.waiting.pop(self, None)
        self.guard.waiting[self] = None

    def _check_head(self) -> None:
        if self._head_timer is not None and self.cycle is not self._cycle_before:
            self._head_timer.cancel()
            self._head_timer = None
            self.guard.waiting.pop(self, None)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        self.guard.waiting.pop(self, None)
        if not self.transport.is_closing():
            self.guard.stats.num_header_timeouts += 1
            if self.conn.trailing_data[0]:  # part of a head arrived: say why; an idle keep-alive just closes
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
