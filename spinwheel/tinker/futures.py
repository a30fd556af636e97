"""Tinker's request/future pattern: a request is answered at once with a ``request_id``; the client polls
``/api/v1/retrieve_future`` until the result is there.

Each future is pending, done (a JSON object, or protobuf bytes for ``ForwardBackwardOutput`` / ``SampleResponse``,
which the SDK reads only as protobuf) or failed (a message and a category: ``user`` for the request's own fault, which
the SDK raises as ``tinker.RequestFailedError``, ``server`` otherwise). A poll waits for the result a while before it
answers ``try_again`` (long polling: fewer round trips than the SDK's immediate re-poll). Finished results are kept
until retrieved twice or until ``keep`` newer ones have finished, so a poll the client retries still finds its
result.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    value: Any = None  # dict (JSON) or bytes (protobuf)
    error: str | None = None
    category: str = "user"
    retrieved: int = 0


class FutureStore:
    def __init__(self, keep: int = 4096) -> None:
        self._ids = itertools.count(1)
        self._pending: set[str] = set()
        self._done: OrderedDict[str, Outcome] = OrderedDict()
        self._cond = threading.Condition()
        self.keep = keep

    def create(self) -> str:
        with self._cond:
            rid = f"req-{next(self._ids)}"
            self._pending.add(rid)
            return rid

    def _finish(self, rid: str, outcome: Outcome) -> None:
        with self._cond:
            self._pending.discard(rid)
            self._done[rid] = outcome
            while len(self._done) > self.keep:
                self._done.popitem(last=False)
            self._cond.notify_all()

    def set_result(self, rid: str, value: Any) -> None:
        self._finish(rid, Outcome(value=value))

    def set_error(self, rid: str, message: str, category: str = "user") -> None:
        self._finish(rid, Outcome(error=message, category=category))

    def known(self, rid: str) -> bool:
        with self._cond:
            return rid in self._pending or rid in self._done

    def poll(self, rid: str, wait: float) -> Outcome | None:
        """The outcome of ``rid`` once finished, waiting up to ``wait`` seconds; None while still pending. Called
        from a worker thread of the HTTP server (never the event loop)."""
        deadline = time.monotonic() + wait
        with self._cond:
            while rid in self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            outcome = self._done.get(rid)
            if outcome is not None:
                outcome.retrieved += 1
                if outcome.retrieved >= 2:
                    self._done.pop(rid, None)
            return outcome
