"""The engine on its own thread, with an asyncio face.

:class:`~spinwheel.engine.LLMEngine` is synchronous and not thread-safe, and one ``step`` is a model forward that
would block an event loop. So the engine lives on one dedicated thread that owns it outright: request handlers
post ``add`` / ``abort`` commands to a queue, the thread applies them between steps, runs ``step`` while any request
is unfinished, and hands each :class:`RequestOutput` to the request's mailbox on the event loop with
``call_soon_threadsafe``. The event loop never waits on the model. This is the in-process mode (tests, the RL loop,
``spinwheel serve --no-engine-process``); :mod:`~spinwheel.server.engine_client` has the same face over an engine
in its own process.

Outputs are cumulative, so a request's mailbox keeps only the latest: a handler that reads slowly (its client
does) gets fewer, larger deltas, and one request holds at most one unread output however far behind it falls.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from spinwheel.engine import LLMEngine, RequestOutput, SamplingParams
from spinwheel.engine.core import EngineCore

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (after an internal error); the server reports unhealthy."""


class EngineStepError(RuntimeError):
    """One engine step raised; the requests in it were aborted and the engine keeps serving."""


class Stream:
    """One request's mailbox on the event loop: the latest unread output (or the error that ended it)."""

    def __init__(self, owner: StreamingEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.owner, self.loop = owner, loop
        self.latest: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()
        self.closed = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """From the engine thread."""
        self.loop.call_soon_threadsafe(self.offer, item)

    def offer(self, item: RequestOutput | BaseException) -> None:
        if self.closed or isinstance(self.latest, BaseException):
            return  # nobody reads any more, or a failure already ended the request
        if self.latest is None:
            self.owner.num_unread_outputs += 1
        self.latest = item  # supersedes an unread output: it holds everything that one did
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self.ready.wait()
        item, self.latest = self.latest, None
        self.ready.clear()
        self.owner.num_unread_outputs -= 1
        return item  # type: ignore[return-value]

    def close(self) -> None:
        if self.latest is not None:
            self.owner.num_unread_outputs -= 1
            self.latest = None
        self.closed = True


class StreamingEngine(abc.ABC):
    """What request handlers drive: ``async for out in engine.generate(...)``, ``abort``, ``alive``. Subclasses
    say how a request reaches the engine (``_submit``) and its outputs come back (``Stream.put`` / ``offer``)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None  # why the engine stopped (``alive`` is False then)
        self.num_unread_outputs = 0  # requests whose latest output waits for its handler (event-loop side)

    @property
    @abc.abstractmethod
    def alive(self) -> bool: ...

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs as they progress; the last one has ``finished``. Leaving the
        loop early (a client that disconnected, a cancelled task) aborts the request and frees its blocks."""
        if not self.alive:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        stream = Stream(self, asyncio.get_running_loop())
        self._submit(request_id, prompt, params, stream)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            stream.close()
            if not finished:
                self.abort(request_id)

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def _submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, stream: Stream) -> None: ...


class AsyncEngine(StreamingEngine, EngineCore):
    """Drive an :class:`LLMEngine` on a thread of this process: the :class:`~spinwheel.engine.core.EngineCore` loop,
    its outputs handed to the requests' streams."""

    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[list[RequestOutput], float], None] | None = None,
        idle_wait_s: float = 0.05,
    ) -> None:
        StreamingEngine.__init__(self)
        EngineCore.__init__(self, engine, idle_wait_s)
        self._on_step = on_step
        self._streams: dict[str, Stream] = {}  # touched by the engine thread only
        self.num_step_errors = 0
        self._thread = threading.Thread(target=self._run, name="spinwheel-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def seconds_without_progress(self) -> float:
        """How long the engine has had work without progress (0 when idle): what ``/health`` compares with its
        limit. Read from the event loop while the engine thread steps; it only reads two attributes."""
        return self.engine.seconds_without_progress()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop()
        self._thread.join(timeout)

    # ---- asyncio side ----
    def _submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, stream: Stream) -> None:
        self.post(("add", request_id, prompt, params, stream))

    def abort(self, request_id: str) -> None:
        self.post(("abort", request_id))

    # ---- engine thread ----
    def apply(self, commands: Iterator[tuple]) -> None:
        for command in commands:
            if command[0] == "add":
                _, request_id, prompt, params, stream = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as e:  # bad request: hand the error to its handler, keep serving
                    stream.put(e)
                    continue
                self._streams[request_id] = stream
            else:
                if self.engine.abort(command[1]):
                    self._streams.pop(command[1], None)

    def step(self) -> list[RequestOutput]:
        return self.engine.step(stream=True)

    def deliver(self, outputs: list[RequestOutput], step_s: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its handler
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
        if self._on_step is not None:
            self._on_step(outputs, step_s)

    def step_failed(self, error: Exception) -> None:
        """An engine bug on some input: fail the requests in flight, keep serving."""
        logger.exception("engine step failed; aborting the requests in flight", exc_info=error)
        self.num_step_errors += 1
        self._fail_all(EngineStepError(f"the engine failed on this batch: {error!r}"), abort=True)

    def _run(self) -> None:
        try:
            self.run()
        except BaseException as e:  # the thread itself broke: fail every waiting request instead of hanging it
            logger.exception("engine thread stopped")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine stopped: {e!r}"), abort=False)

    def _fail_all(self, error: Exception, abort: bool) -> None:
        for request_id, stream in self._streams.items():
            stream.put(error)
            if abort:
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - best effort; the error already reached the client
                    logger.exception("abort of %s failed", request_id)
        self._streams.clear()
        if abort:
            try:
                self.engine.step(stream=False)  # let the engine free the aborted requests' blocks
            except Exception:  # noqa: BLE001
                logger.exception("engine step after a failure also failed")
