"""An :class:`~spinwheel.engine.core.EngineCore` in a child process of its own (vLLM v1's ``EngineCoreProc`` and
the client end of ``EngineCoreClient``): :class:`EngineCoreProcess` starts it and talks to it; :class:`PipeCore` is
the child's end. Both clients use it: the server's engine process (:mod:`~spinwheel.server.engine_client`, its
core :mod:`~spinwheel.server.engine_process`) and the RL loop's rollout engine process
(:mod:`~spinwheel.rl.llm.rollouts.rollout_engine`); each says what its commands and messages mean.

The one transport is a duplex pipe (:mod:`multiprocessing.connection`: length-prefixed pickles), with a writer and
a reader thread at each end, so no caller ever waits on the pipe:

- client -> core: lists of commands (tuples whose first item names the command; ``("shutdown",)`` ends the core).
  The client's writer sends every command queued since its last write in one message (a burst of requests costs
  one write); the core's reader queues them for its loop, which applies them between two steps.
- core -> client: ``("ready", info)`` once built (or ``("start_failed", text)``), then the client's own messages
  (each step's outputs, answers to calls, failures), written off the stepping thread; the client's reader hands
  each one to the client's ``on_message``.

What the engine is built from (the ``spec``) travels once, as the process's argument, so tensors in it (a model's
weights, RL's shared-memory copy) are shared with the child, not copied. The pipe closes when the child dies (a
crash, the OOM killer, SIGKILL): the client's reader sees it at once and calls ``on_exit``. The child ignores
SIGINT and leaves the client's process group: the client decides when its engine stops; the core stops when told
to or when the pipe closes (the client went away).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

from spinwheel.engine.core import EngineCore
from spinwheel.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class CoreSpec(Protocol):
    """What the child builds its core from (pickled to it once, as the process's argument)."""

    num_threads: int | None  # torch threads of the child (None: torch's default)

    def start(self, conn: Connection) -> tuple[PipeCore, Any]:
        """Build the engine and its core on ``conn``; the core and what the client is told with ``ready``."""


def serve_core(spec: CoreSpec, conn: Connection) -> None:
    """The child's entry point (``multiprocessing`` target): build the core, say ready, run it until it stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(os, "setpgrp"):  # a signal to the client's process group (Ctrl-C, `timeout`, `kill -TERM -PGID`) is
        os.setpgrp()  # the client's to act on: it stops this engine in order, rather than seeing it die
    try:
        if spec.num_threads is not None:
            import torch

            torch.set_num_threads(spec.num_threads)
        core, info = spec.start(conn)
    except BaseException as e:  # noqa: BLE001 - reported to the client, which says why it cannot start
        try:
            conn.send_bytes(dumps(("start_failed", f"{type(e).__name__}: {e}")))
        except OSError:
            pass
        return
    core.send(("ready", info))  # the first message out: nothing else is sent before the loop runs
    try:
        core.run()
    finally:
        core.close()
        conn.close()


class PipeCore(EngineCore):
    """The child's end: a reader thread queues the client's commands for the loop (a closed pipe is a
    ``("shutdown",)``), :meth:`send` hands a message to the writer thread. Subclasses say what the commands do."""

    def __init__(self, engine: LLMEngine, conn: Connection, idle_wait_s: float = 1.0) -> None:
        super().__init__(engine, idle_wait_s)
        self.conn = conn
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, name="spinwheel-engine-reader", daemon=True).start()
        self._writer = threading.Thread(target=self._write, name="spinwheel-engine-writer", daemon=True)
        self._writer.start()

    def _read(self) -> None:
        """Drain the pipe as commands arrive (so the client's writes never wait on a step)."""
        while True:
            try:
                batch = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                batch = [("shutdown",)]  # the client went away
            for command in batch:
                self.commands.put(command)
            self.wake.set()
            if batch and batch[-1][0] == "shutdown":
                return

    def send(self, message: tuple) -> None:
        self._outbox.put(dumps(message))

    def _write(self) -> None:
        """Write to the pipe off the stepping thread: a write wakes the client's reader, and on a busy machine the
        scheduler may run it in the writer's place; meanwhile the next step goes on here. Ends with ``None``."""
        while (data := self._outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the client went away: the reader sees it too and stops the core
                return

    def close(self) -> None:
        """Send what is queued, then stop the writer."""
        self._outbox.put(None)
        self._writer.join(10)


class EngineCoreProcess:
    """Start a core in a child process (``ctx``: a multiprocessing context, spawn or fork server) built from ``spec``
    and wait until it is ready (``info``: what it said; RuntimeError if it cannot start). :meth:`post` queues a
    command; :meth:`serve` starts the reader, which hands each message to ``on_message`` and calls
    ``on_exit(failure)`` once the pipe has closed (``failure``: why, when ``on_message`` raised; the child was
    stopped)."""

    def __init__(self, ctx: Any, spec: CoreSpec, start_timeout_s: float, name: str = "spinwheel-engine") -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=serve_core, args=(spec, child_conn), name=name, daemon=True)
        self.closed = False  # close() was called: the writer ends
        self.released = False  # the process has ended and its descriptors are released
        self.exitcode: int | None = None
        self.lock = threading.Lock()  # guards the process object: join and close come from two threads
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.proc.start()
        self.pid = self.proc.pid
        child_conn.close()  # the child's end lives in the child only: its death closes the pipe
        self.info = self._wait_ready(start_timeout_s)
        threading.Thread(target=self._write, name="spinwheel-engine-writer", daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        try:
            while not self.conn.poll(0.2):
                if not self.proc.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the engine process did not start within {timeout_s:g} s")
            message = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            exitcode = self.join(5)
            self.close()
            raise RuntimeError(f"the engine process {describe_exit(exitcode)} while starting") from None
        if message[0] != "ready":
            self.close()
            raise RuntimeError(f"the engine could not start: {message[1]}")
        return message[1]

    def serve(self, on_message: Callable[[tuple], None], on_exit: Callable[[str | None], None]) -> None:
        """Start the reader thread: each message to ``on_message``, then ``on_exit`` once the pipe has closed."""
        args = (on_message, on_exit)
        threading.Thread(target=self._read, args=args, name="spinwheel-engine-client", daemon=True).start()

    def _read(self, on_message: Callable[[tuple], None], on_exit: Callable[[str | None], None]) -> None:
        failure = None
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                break
            try:
                on_message(message)
            except Exception as e:  # a bug here must not leave every caller waiting: stop the child instead
                logger.exception("the engine's %r message could not be handled", message[0])
                failure = f"the engine client failed on the engine's output ({e!r}): the engine process was stopped"
                self.close()
                break
        on_exit(failure)

    def post(self, command: tuple) -> None:
        """Queue a command for the writer (from any thread)."""
        self.outbox.put(command)
        self.wake.set()

    def _write(self) -> None:
        while not self.closed:
            self.wake.wait()
            self.wake.clear()
            batch = []
            while True:
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            if not batch or self.closed:
                continue
            try:
                self.conn.send_bytes(dumps(batch))
            except (OSError, ValueError):  # the process died (the reader reports it) or the pipe was closed
                return
            if batch[-1][0] == "shutdown":
                return

    def join(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the process to end; its exit code (None while it runs)."""
        with self.lock:
            if not self.released:
                self.proc.join(timeout)
                self.exitcode = self.proc.exitcode
        return self.exitcode

    def shutdown(self, timeout: float) -> None:
        """Ask the core to stop, wait up to ``timeout`` seconds, then :meth:`close`."""
        self.post(("shutdown",))
        self.join(timeout)
        self.close()

    def close(self) -> None:
        """Close the pipe, stop the process and the writer thread, and release the process's descriptors (its
        sentinel pipe stays open until ``Process.close``): a restart leaves nothing of this child behind."""
        self.closed = True
        self.wake.set()  # the writer waits for work: let it see ``closed`` and end
        with self.lock:  # the reader thread and shutdown may both close it
            self.conn.close()
            if self.released:
                return
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
            self.exitcode = self.proc.exitcode
            if self.exitcode is not None:
                self.proc.close()
                self.released = True
