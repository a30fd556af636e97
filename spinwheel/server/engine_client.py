"""The server's side of an engine in its own process (:mod:`~spinwheel.server.engine_process`), with the same
asyncio face as :class:`~spinwheel.server.async_engine.AsyncEngine`.

The process, its pipe and their two threads are :class:`~spinwheel.engine.process.EngineCoreProcess` (the engine
process class the RL rollout engine uses too): its writer sends the handlers' commands (every command queued since
its last write goes in one message, so a burst of requests costs one write), and its reader hands each message to
this client, which turns each step's deltas back into cumulative outputs (detokenizing the new tokens and checking
stop strings here, :mod:`~spinwheel.server.output_deltas`; a stop string found sends the engine a stop or abort) and
hands them to the requests' mailboxes with one ``call_soon_threadsafe`` per step, not per request. Text prompts are
tokenized here.

Liveness: the pipe closes when the engine process dies (a crash, the OOM killer, SIGKILL). The reader then fails
every request in flight with :class:`EngineDeadError` (an OpenAI error object for its client, 503), ``alive`` is
False (``/health`` answers 503) and new requests are refused at once, then the process is started again, up to
``max_restarts`` times; after that ``on_exit`` is called with the reason, and ``spinwheel serve`` exits with it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as torch_mp  # registers the reducers that share a model's tensors with the child

from spinwheel.engine import EngineStats, RequestOutput, SamplingParams
from spinwheel.engine.isolation import INTERNAL_ERROR
from spinwheel.engine.process import EngineCoreProcess, describe_exit
from spinwheel.server.async_engine import EngineDeadError, EngineStepError, Stream, StreamingEngine
from spinwheel.server.engine_process import EngineSnapshot, EngineSpec
from spinwheel.server.output_deltas import DeltaDecoder, RequestDelta

logger = logging.getLogger(__name__)


def _offer_all(items: list[tuple[Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.offer(item)


def _deliver(items: list[tuple[Stream, RequestOutput | BaseException]]) -> None:
    """Hand outputs to their mailboxes: one callback per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_offer_all, batch)
        except RuntimeError:  # that loop has closed: nobody is reading
            pass


class EngineProcess(StreamingEngine):
    """Drive an engine that runs in its own process, built there from ``spec``. The constructor returns once the
    engine has loaded (RuntimeError if it cannot). ``on_step(outputs, step_s)`` (metrics) runs on the reader
    thread after every step; ``on_exit(reason)`` once, when the engine has died and will not be restarted."""

    def __init__(
        self,
        spec: EngineSpec,
        max_restarts: int = 3,
        on_exit: Callable[[str], None] | None = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        super().__init__()
        self.spec, self.config = spec, spec.config
        self.tokenizer = spec.load_tokenizer()
        self.max_restarts, self.on_exit, self.start_timeout_s = max_restarts, on_exit, start_timeout_s
        self.on_step: Callable[[list[RequestOutput], float], None] | None = None
        self.num_restarts = 0
        self._lock = threading.Lock()  # guards _streams and error between the event loop and the reader
        self._streams: dict[str, Stream] = {}
        self._closing = False
        self._last_progress = time.monotonic()
        self._start()

    def _start(self) -> None:
        child = EngineCoreProcess(torch_mp.get_context("spawn"), self.spec, self.start_timeout_s)
        self.info = child.info
        self._snapshot = EngineSnapshot(child.info.stats, False, 0, 0)
        self._decoder = DeltaDecoder(self.tokenizer)
        self._child = child
        if self._closing:  # shut down while this one was starting (a restart)
            child.close()
            return
        child.serve(self._on_message, functools.partial(self._on_exit, child))
        with self._lock:
            self.error = None

    # ---- what the server reads ----
    @property
    def alive(self) -> bool:
        return self.error is None and not self._closing

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def lora_names(self) -> tuple[str, ...]:
        return self.info.loras

    def stats(self) -> EngineStats:
        """The engine's stats after its latest step."""
        return self._snapshot.stats

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def has_unfinished_requests(self) -> bool:
        return bool(self._streams) or self._snapshot.has_unfinished

    def seconds_without_progress(self, now: float | None = None) -> float:
        """How long requests have been in flight without a step that produced output (0 when idle), measured here:
        an engine process that hangs sends nothing at all."""
        if not self.has_unfinished_requests():
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self._last_progress)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._child.shutdown(timeout)

    # ---- asyncio side ----
    def _submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, stream: Stream) -> None:
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, prompt)
        with self._lock:
            error = self.error
            if error is None:
                if not self._streams and not self._snapshot.has_unfinished:
                    self._last_progress = time.monotonic()  # work arrives at an idle engine: a stall counts from now
                self._streams[request_id] = stream
                self._decoder.add(request_id, text, ids, params)
                self._child.post(("add", request_id, ids, params))
        if error is not None:  # died between the caller's check and now
            stream.offer(EngineDeadError(f"the engine has stopped: {error!r}"))

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is not None and self.error is None:
                self._child.post(("abort", request_id))  # its "abort" output still reaches the metrics

    # ---- the reader thread ----
    def _on_message(self, message: tuple) -> None:
        if message[0] == "step":
            self._on_step(*message[1:])
        elif message[0] == "failed":
            self._on_failed(*message[1:])

    def _on_step(self, deltas: list[RequestDelta], step_s: float, snapshot: EngineSnapshot) -> None:
        decoder = self._decoder
        outputs, failed = decoder.decode_all(deltas)
        for command in decoder.take_commands():  # stop strings found (or decoding failed): stop, abort, free
            self._child.post(command)
        for request_id, e in failed:
            error = f"{INTERNAL_ERROR}the server failed on this request's output ({type(e).__name__}: {e})"
            self._on_failed([request_id], EngineStepError(f"{error}; the other requests were not affected"))
        self._snapshot = snapshot
        if outputs:
            self._last_progress = time.monotonic()
        items: list[tuple[Stream, Any]] = []
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted by its handler
                if out.finished:
                    del self._streams[out.request_id]
                items.append((stream, out))
        _deliver(items)
        if self.on_step is not None:
            self.on_step(outputs, step_s)

    def _on_failed(self, request_ids: list[str], error: BaseException) -> None:
        with self._lock:
            items = [(self._streams.pop(rid), error) for rid in request_ids if rid in self._streams]
        for rid in request_ids:
            self._decoder.forget(rid)
        _deliver(items)

    def _on_exit(self, child: EngineCoreProcess, failure: str | None = None) -> None:
        exitcode = child.join(5)
        if self._closing:
            child.close()
            return
        reason = failure or f"the engine process (pid {child.pid}) {describe_exit(exitcode)}"
        logger.error("%s; failing the requests in flight", reason)
        error = EngineDeadError(reason)
        with self._lock:
            self.error = error
            items = [(stream, error) for stream in self._streams.values()]
            self._streams.clear()
        _deliver(items)
        child.close()
        start_error = None
        while self.num_restarts < self.max_restarts and not self._closing:
            self.num_restarts += 1  # a replacement that dies while starting uses a restart, and the next one goes on
            logger.warning("restarting the engine process (restart %d of %d)", self.num_restarts, self.max_restarts)
            try:
                self._start()
                logger.warning("the engine process is back (pid %d)", self.pid)
                return
            except RuntimeError as e:
                start_error = e
                logger.error("restart %d of %d failed: %s", self.num_restarts, self.max_restarts, e)
                with self._lock:
                    self.error = EngineDeadError(f"{reason}, and a new one could not start: {e}")
        if self._closing:
            return
        if start_error is not None:
            reason = f"{reason}, and a new one could not start: {start_error}"
        reason = f"{reason} ({self.max_restarts} restart(s) allowed, all used)"
        logger.error("%s", reason)
        if self.on_exit is not None:
            self.on_exit(reason)
