"""A uvicorn app on a loopback port in a background thread (tests, benchmarks, notebooks): the OpenAI server's
:class:`~spinwheel.server.serve.BackgroundServer` and the Tinker service's
:class:`~spinwheel.tinker.serve.BackgroundTinker` are both this, with their own app and their own clean-up."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Self

START_TIMEOUT_S = 30.0


class UvicornThread:
    """``port=0`` picks a free port. ``serve(config)`` builds the uvicorn server; entering starts it and waits until
    it listens (an error naming the URL if it has not within :data:`START_TIMEOUT_S`, or its thread died); leaving
    stops it, then calls :meth:`stopped`."""

    what = "server"  # named in the start-up error

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve(self, config: Any) -> None:
        import uvicorn

        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)

    def stopped(self) -> None:
        """What to release once the server has stopped (nothing here)."""

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.what} did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(10)
        self.stopped()
