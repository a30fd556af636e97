"""The worker processes of a multi-process engine, as its driver sees them: the tensor-parallel workers
(:mod:`~spinwheel.engine.parallel.tp_executor`) and the pipeline stages (:mod:`~spinwheel.engine.parallel.pp_executor`)
are started,
fed and stopped alike. Ranks 1 … N − 1 are spawned from multiprocessing's fork server, each with a pipe whose far
end lives in that process only (the driver's death closes it, which ends the worker); every message to them is one
pickle sent to all; one that exited is noticed before each send and when a collective or transfer fails, and the
engine then raises an error naming it; :meth:`WorkerProcesses.close` stops them, killing what does not stop.

Start-up is watched, not waited out: a worker says it is about to join the process group (:data:`JOINING`) before
the driver joins it, and the driver waits for that and for each worker's first message on the pipes and on the
processes' sentinels together, so a worker that fails (its exception sent as one line, :class:`WorkerFailed`) or
exits is reported at once, not after the rendezvous' timeout. A worker imports the script that started the engine
(multiprocessing's rule); a script without the ``if __name__ == '__main__':`` guard would start an engine again
there: the worker exits with :data:`NO_MAIN_GUARD_EXIT` instead, and the driver's error says how to fix the
script."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from spinwheel.parallel.launch import free_port
from spinwheel.user_code import one_line

JOINING = "joining"  # a worker's first message: its start-up went well and it joins the process group now
NO_MAIN_GUARD_EXIT = 86  # the exit status of a worker in which the main script started an engine again


@dataclass
class WorkerFailed:
    """What a worker sends its driver when it fails: its exception on one line (``Type: message``)."""

    error: str


def run_worker(target: Callable[..., None], *args: Any) -> None:
    """In a worker: ``target(*args)`` (``args[5]`` its pipe); an exception goes to the driver as
    :class:`WorkerFailed`, and the worker exits with status 1 (its traceback printed only if the driver is gone)."""
    try:
        target(*args)
    except Exception as e:
        try:
            args[5].send(WorkerFailed(one_line(e)))
        except (OSError, ValueError):
            raise e from None
        sys.exit(1)


class TensorParallelError(RuntimeError):
    """A worker of a multi-process engine is gone or a collective failed: the engine cannot step any more (close
    it). A lost pipeline stage raises its subclass."""


@contextlib.contextmanager
def may_have_children() -> Iterator[None]:
    """Let a daemonic process (``spinwheel serve``'s engine process) start the workers, which multiprocessing
    refuses by default: they are daemons of their own, ended with it (and on its death by their closed pipe)."""
    config = mp.current_process()._config  # type: ignore[attr-defined]
    daemonic = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemonic


class WorkerProcesses:
    """Ranks 1 … N − 1 of an engine, from its driver (rank 0). A subclass names them (``kind``: "tensor-parallel
    worker"), what fails when one is gone (``link``: "a collective of the tensor-parallel group"), the engine and
    the option that asks for it (``engine``, ``degree``), the error it raises, the modules its fork server preloads,
    and its ``close`` sends the message that stops a worker.

    The driver's start-up, in order: ``__init__`` (refused where a process group exists already), :meth:`start`
    for each worker, :meth:`join` (the process group on ``init_method``), then :meth:`started` (each worker's
    first message)."""

    kind = "worker"
    link = "a collective"
    engine = "tensor-parallel engine"
    degree = "tensor_parallel_size"
    error_class: type[TensorParallelError] = TensorParallelError
    preload: list[str] = ["torch", "torch.distributed", "spinwheel", "spinwheel.engine"]

    def __init__(self, world: int, timeout_s: float) -> None:
        """A driver of ``world`` ranks (itself included) whose every start-up wait lasts at most ``timeout_s``."""
        if getattr(mp.current_process(), "_inheriting", False):  # a worker importing an unguarded main script
            os._exit(NO_MAIN_GUARD_EXIT)
        if dist.is_initialized():
            raise RuntimeError(
                f"{self.degree} > 1 starts its own process group, and this process has one already "
                f"(a torchrun job?): run the {self.engine} in a process of its own"
            )
        self.world, self.timeout_s = world, timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.failure: str | None = None

    def start(self, rank: int, target: Callable[..., None], args: tuple, name: str) -> None:
        """Spawn rank ``rank`` running ``target(*args[:5], pipe, *args[5:])``."""
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(self.preload)
        parent, child = ctx.Pipe()
        args = (target, *args[:5], child, *args[5:])
        proc = ctx.Process(target=run_worker, args=args, daemon=True, name=f"{name}-{rank}")
        with may_have_children():
            proc.start()
        child.close()  # the worker's end lives in the worker only: the driver's death closes the pipe
        self.procs.append(proc)
        self.conns.append(parent)

    def join(self, backend: str) -> None:
        """Join the workers' process group as rank 0, once every worker is joining it (:meth:`next_messages`); one
        that fails or exits first, or never joins, closes the engine and raises ``error_class``."""
        self.next_messages("start")
        try:
            dist.init_process_group(
                backend, init_method=self.init_method, rank=0, world_size=self.world, timeout=self.timeout
            )
        except Exception as e:
            self.fail(self.dead() or f"a {self.kind} did not join within {self.timeout_s:.0f}s ({one_line(e)})")

    def started(self) -> list[Any]:
        """The first message of each worker (the executors': its memory), once it has built its part of the model;
        one that sends none within ``timeout_s`` closes the engine and raises ``error_class``."""
        return self.next_messages("start")

    def next_messages(self, what: str) -> list[Any]:
        """Each worker's next message, in rank order, waiting on the pipes and the processes together: a worker that
        fails (:class:`WorkerFailed`) or exits meanwhile, or sends nothing within ``timeout_s`` (it did not
        ``what``), closes the engine and raises ``error_class`` at once, in one line."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < len(self.conns):
            waiting = {r: (c, p) for r, (c, p) in enumerate(zip(self.conns, self.procs), 1) if r not in got}
            handles = [h for c, p in waiting.values() for h in (c, p.sentinel)]
            ready = wait(handles, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.fail(f"{self.kind} {min(waiting)} did not {what} within {self.timeout_s:.0f}s")
            for rank, (conn, proc) in waiting.items():
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    got[rank] = self.receive(rank, conn, proc)
                elif proc.sentinel in ready:
                    self.fail(self.exited(rank, proc))
        return [got[r] for r in sorted(got)]

    def receive(self, rank: int, conn: Any, proc: Any) -> Any:
        """One message from worker ``rank``; its failure or its exit instead raises (:meth:`fail`)."""
        try:
            message = conn.recv()
        except (EOFError, OSError):
            self.fail(self.exited(rank, proc))
        if isinstance(message, WorkerFailed):
            self.fail(f"{self.kind} {rank} failed: {message.error}")
        return message

    def exited(self, rank: int, proc: Any) -> str:
        """Why worker ``rank``, which exited, is gone (its status; for :data:`NO_MAIN_GUARD_EXIT`, the fix)."""
        proc.join(1.0)
        if proc.exitcode == NO_MAIN_GUARD_EXIT:
            script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
            return (
                f"{self.kind} {rank} could not start: it imported {script}, which started a {self.engine} again "
                f"(worker processes import the main script): start the engine under "
                "`if __name__ == '__main__':` in it"
            )
        return f"{self.kind} {rank} (pid {proc.pid}) exited with code {proc.exitcode} while the engine started"

    def fail(self, failure: str) -> NoReturn:
        """Close the engine and raise ``error_class`` with ``failure`` (one line, no chained error)."""
        self.failure = failure
        self.close()
        raise self.error_class(failure) from None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers: :meth:`stop_workers` with the subclass's stop message."""
        raise NotImplementedError

    def dead(self) -> str | None:
        """Which worker exited, if one did."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            if proc.exitcode is not None:
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll():  # its last word, if it failed
                        if isinstance(message := conn.recv(), WorkerFailed):
                            return f"{self.kind} {rank} (pid {proc.pid}) failed: {message.error}"
                return f"{self.kind} {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def send_all(self, message: Any) -> None:
        """Pickle ``message`` once and send it to every worker (raises ``error_class`` if one is gone)."""
        if self.failure is None:
            self.failure = self.dead()
        if self.failure is not None:
            raise self.error_class(f"{self.failure}; the engine cannot continue: close it")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            raise self.error(e) from e

    def error(self, exc: BaseException) -> TensorParallelError:
        """The error a failed step raises: the worker that is gone if any (a collective failing with a dead peer),
        else the collective's own error."""
        for _ in range(20):  # a killed peer breaks the collective before its exit code is visible
            self.failure = self.dead()
            if self.failure is not None:
                break
            for proc in self.procs:
                proc.join(0.05)
        self.failure = self.failure or f"{self.link} failed ({exc})"
        return self.error_class(f"{self.failure}; the engine cannot continue: close it")

    def stop_workers(self, stop: Any, timeout_s: float = 5.0) -> None:
        """Send ``stop`` to the workers, kill any that do not stop within ``timeout_s``, leave the process group."""
        data = pickle.dumps(stop)
        for conn, proc in zip(self.conns, self.procs):
            try:
                if proc.exitcode is None:
                    conn.send_bytes(data)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout_s if self.failure is None else 0.5)
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout_s)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if dist.is_initialized():
            dist.destroy_process_group()


def join_engine_group(
    rank: int,
    world: int,
    init_method: str,
    backend: str,
    on_gpu: bool,
    timeout_s: float,
    flush_denormal: bool,
    conn: Any,
) -> torch.device:
    """In a worker: its device (GPU ``rank`` with ``on_gpu``), its share of the CPU threads and the engine's
    denormal setting; then tell the driver (:data:`JOINING`, on ``conn``) and join its process group. Returns the
    device."""
    device = torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.set_flush_denormal(flush_denormal)
    timeout = datetime.timedelta(seconds=timeout_s)
    conn.send(JOINING)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    return device


def driver_steps(conn: Any) -> Iterator[Any]:
    """In a worker: each message the driver sends, until its ``stop`` or until the driver is gone (its end of the
    pipe closed)."""
    while True:
        try:
            step = conn.recv()
        except EOFError:
            return
        if step.stop:
            return
        yield step
