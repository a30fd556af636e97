"""Torch CPU threads on a shared machine: as many as the cores other processes leave free, re-fitted as they come
and go.

PyTorch starts one OpenMP thread per core, and libgomp's threads wait for each other at the end of every parallel
region by spinning (for milliseconds, on the default ``GOMP_SPINCOUNT``). When another process holds a core, one
of our threads is descheduled for a scheduler time slice while its partner spins at the barrier, so each of the
dozens of parallel regions of a step can cost a time slice: next to one busy process on 2 cores, engine generation
fell to 0.08–0.33× of its quiet speed, SFT and GRPO steps to 0.3× (``benchmarks/contention.py``; BENCHMARKS.md,
"Speed on a busy machine"). A passive wait policy (``OMP_WAIT_POLICY=passive``) keeps 0.7–0.9× there but costs a
third of the quiet speed (every region then wakes a sleeping thread). One thread is immune, but 2 threads are
1.3–1.6× faster on a quiet machine.

So :func:`fit_threads` measures instead of guessing: called at the start of each engine or training step (in the
thread that computes, as OpenMP's thread count belongs to the calling thread), it samples ``/proc/stat`` at most
every :data:`INTERVAL_S` and sets ``torch.set_num_threads`` to the CPUs not used by other processes over that
interval (our own process's CPU time is taken out), between 1 and the count in force before (torch's default, or
what ``--num-threads`` / ``torch.set_num_threads`` chose: a cap it never exceeds). On a quiet machine nothing
changes; next to a busy process a step runs on the core left free, in no barrier with the other process.

``SPINWHEEL_THREADS=off`` turns it off (torch's threads as set, never re-fitted). Without ``/proc/stat`` (not
Linux) it does nothing.
"""

from __future__ import annotations

import os
import threading
import time

ENV = "SPINWHEEL_THREADS"
INTERVAL_S = 0.2  # how often the free CPUs are measured (and the thread count re-fitted) at most
_PROC_STAT = "/proc/stat"
_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def enabled() -> bool:
    """Whether the thread count is fitted to the free CPUs (``SPINWHEEL_THREADS`` unset or ``auto``)."""
    return os.environ.get(ENV, "auto").strip().lower() != "off" and os.path.exists(_PROC_STAT)


def busy_cpu_seconds(count_nice: bool = False) -> float:
    """CPU seconds all CPUs of the machine have spent busy since boot: user, system, irq, softirq and steal time
    from ``/proc/stat``; user time of processes with a positive nice value (which yield to ours) only with
    ``count_nice`` (for a process that is itself niced: its own time is counted there)."""
    with open(_PROC_STAT, "rb") as f:
        first = f.readline()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first.split()[1:9])
    return (user + system + irq + softirq + steal + (nice if count_nice else 0)) * _TICK_S


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_cpus(busy_delta: float, own_delta: float, elapsed: float, cpus: int, usable: int) -> float:
    """CPUs left free by other processes over an interval: ``busy_delta`` CPU seconds busy machine-wide,
    ``own_delta`` of them ours, over ``elapsed`` seconds on ``cpus`` CPUs, of which ``usable`` are ours to use."""
    others = max(0.0, busy_delta - own_delta) / max(elapsed, 1e-9)
    return max(0.0, min(float(usable), cpus - others))


def threads_for(free: float, cap: int) -> int:
    """The thread count for ``free`` CPUs: the nearest whole number, at least 1 and at most ``cap``."""
    return max(1, min(cap, int(free + 0.5)))


class _State(threading.local):
    """One computing thread's measurements (OpenMP's thread count is per thread)."""

    def __init__(self) -> None:
        self.t: float | None = None
        self.busy = self.own = 0.0
        self.cap = self.threads = 0


_state = _State()


def sample_cpu() -> tuple[float, float]:
    """(CPU seconds busy machine-wide, CPU seconds of this process) now."""
    return busy_cpu_seconds(_NICED), time.process_time()


def fit_threads() -> int | None:
    """Fit this thread's torch threads to the CPUs other processes leave free (see the module docstring); cheap
    between measurements (a clock read). Returns the thread count, or ``None`` when fitting is off."""
    if not _ENABLED:
        return None
    st = _state
    now = time.monotonic()
    if st.t is not None and now - st.t < INTERVAL_S:
        return st.threads
    import torch

    current = torch.get_num_threads()
    if current != st.threads:  # first call, or someone set the count: that is the cap from now on
        st.cap = st.threads = current
    try:
        busy, own = sample_cpu()
    except (OSError, ValueError):
        return current
    if st.t is not None:
        free = free_cpus(busy - st.busy, own - st.own, now - st.t, _CPUS, usable_cpus())
        want = threads_for(free, st.cap)
        if want != current:
            torch.set_num_threads(want)
            st.threads = want
    st.t, st.busy, st.own = now, busy, own
    return st.threads


_ENABLED = enabled()
_CPUS = os.cpu_count() or 1  # the CPUs /proc/stat counts
_NICED = hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) > 0
