"""Engine-process restarts (issue 28, item 7): each restart used to leave two descriptors (the dead process's
sentinel pipe) and one thread (its command writer, waiting forever) in the API process; and a replacement killed
while it started ended the server with restarts unused. Both reproduced before the fix."""

import multiprocessing
import os
import signal
import threading
import time

import pytest

from spinwheel.engine import EngineConfig
from spinwheel.server.engine_client import EngineProcess
from spinwheel.server.engine_process import EngineSpec


def _spec() -> EngineSpec:
    # a preset by name, as `spinwheel serve` passes it: nothing is shared with the child but the pipe
    return EngineSpec("test", EngineConfig(num_kv_blocks=16, block_size=4, device="cpu"), num_threads=1)


def _counts() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), threading.active_count()


def _wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.slow
def test_restarts_leave_no_descriptor_and_no_thread_behind():
    ep = EngineProcess(_spec(), max_restarts=3)
    try:
        before = _counts()
        for _ in range(2):
            pid = ep.pid
            os.kill(pid, signal.SIGKILL)
            _wait(lambda pid=pid: ep.alive and ep.pid != pid, 120, "the engine process did not come back")
            _wait(lambda: _counts() == before, 5, f"after a restart: {_counts()} (fds, threads), before: {before}")
        assert ep.num_restarts == 2
    finally:
        ep.shutdown()


@pytest.mark.slow
def test_a_replacement_killed_while_starting_uses_the_next_restart():
    gone: list[str] = []
    ep = EngineProcess(_spec(), max_restarts=2, on_exit=gone.append)
    try:
        first = ep.pid
        # children other tests of the session keep (a shared engine-process server) are not the replacement
        others = {p.pid for p in multiprocessing.active_children()}
        os.kill(first, signal.SIGKILL)
        starting: list[int] = []

        def replacement_seen() -> bool:
            known = {first, *others, *starting}
            starting.extend(p.pid for p in multiprocessing.active_children() if p.pid not in known)
            return bool(starting)

        _wait(replacement_seen, 60, "no replacement process was started")
        assert not ep.alive  # it has not said ready yet: killed while it starts
        os.kill(starting[0], signal.SIGKILL)
        _wait(lambda: ep.alive or bool(gone), 120, "neither restarted nor given up")
        assert not gone, gone
        assert ep.num_restarts == 2 and ep.pid not in (first, starting[0])
    finally:
        ep.shutdown()
