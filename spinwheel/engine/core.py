"""The one engine loop (vLLM v1's ``EngineCore``): apply what the clients asked for, then step while work remains.

An :class:`~spinwheel.engine.llm_engine.LLMEngine` is synchronous and not thread-safe, so one thread owns it and
runs :meth:`EngineCore.run`: the commands queued since the last step (``post`` from any thread: add a request,
abort one, stop a sample, shut down) are applied between steps, so requests that arrive during a step join the next
one together; while any request is unfinished the loop steps (schedule -> execute -> process the outputs) and hands
the step's outputs to its client; idle, it waits for a command. A client says what its commands do
(:meth:`~EngineCore.apply`), what a step returns and where it goes (:meth:`~EngineCore.step`,
:meth:`~EngineCore.deliver`) and what a failed step does (:meth:`~EngineCore.step_failed`): the server's
in-process engine thread (:class:`~spinwheel.server.async_engine.AsyncEngine`) and its engine process
(:mod:`~spinwheel.server.engine_process`) step while requests are unfinished; the RL loop's rollout engine process
(:mod:`~spinwheel.rl.llm.rollouts.rollout_engine`) steps when its producer asks (it plays the episodes). Both engine
processes are one class, :mod:`~spinwheel.engine.process`'s ``EngineCoreProcess`` (its child's end, ``PipeCore``,
is the loop's base there): one pipe, each client's own commands and messages over it.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from spinwheel.engine.llm_engine import LLMEngine


def pending(commands: queue.SimpleQueue) -> Iterator:
    """What is in the queue now, oldest first, without waiting."""
    while True:
        try:
            yield commands.get_nowait()
        except queue.Empty:
            return


class EngineCore(ABC):
    """The loop over ``engine``; ``idle_wait_s``: the longest wait for a command while there is no work."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float) -> None:
        self.engine, self.idle_wait_s = engine, idle_wait_s
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stopped = False

    def post(self, command: tuple) -> None:
        """Queue a command for the loop (from any thread) and wake it."""
        self.commands.put(command)
        self.wake.set()

    def stop(self) -> None:
        """End the loop once its current step is done (from any thread)."""
        self.stopped = True
        self.wake.set()

    def run(self) -> None:
        """Apply the queued commands, then one step if work remains (else wait for a command); until stopped."""
        while not self.stopped:
            self.apply(pending(self.commands))
            if self.stopped:
                return
            if not self.has_work():
                self.wait()
                continue
            t0 = time.monotonic()
            try:
                outputs = self.step()
            except Exception as e:  # an engine bug on some input: the client fails the requests in flight
                self.step_failed(e)
                continue
            self.deliver(outputs, time.monotonic() - t0)

    def has_work(self) -> bool:
        """Whether to step now: while any request is unfinished."""
        return self.engine.has_unfinished_requests()

    def wait(self) -> None:
        """Wait for a command (at most ``idle_wait_s``)."""
        self.wake.wait(self.idle_wait_s)
        self.wake.clear()

    @abstractmethod
    def apply(self, commands: Iterator[tuple]) -> None:
        """Apply the commands queued since the last step, oldest first."""

    @abstractmethod
    def step(self) -> Any:
        """One engine step: what it returns for :meth:`deliver`."""

    @abstractmethod
    def deliver(self, outputs: Any, step_s: float) -> None:
        """Hand one step's outputs (and how long it took) to the client."""

    @abstractmethod
    def step_failed(self, error: Exception) -> None:
        """A step raised: fail the requests in flight (and go on) or end the loop."""
