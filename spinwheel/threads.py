"""Torch CPU threads on a shared machine: fewer while other processes hold cores, all again when they let go.

PyTorch starts one OpenMP thread per core, and libgomp's threads wait for each other at the end of every parallel
region by spinning (for milliseconds, on the default ``GOMP_SPINCOUNT``). When another process holds a core, one
of our threads is descheduled for a scheduler time slice while its partner spins at the barrier, so each of the
dozens of parallel regions of a step can cost a time slice: next to one busy process on 2 cores, engine
generation, SFT and GRPO steps fell to 0.24–0.36× of their quiet speed (``benchmarks/contention.py``;
BENCHMARKS.md, "Speed on a busy machine"). A passive wait policy (``OMP_WAIT_POLICY=passive``) keeps 0.7–0.9×
there but costs 26–42% of the quiet speed (every region then wakes a sleeping thread), a bounded
``GOMP_SPINCOUNT`` keeps neither; one thread is immune, but on a quiet machine 2 threads are 1.3–1.6× faster.

So :func:`fit_threads` measures, at the start of each engine or training step, in the thread that computes (an
OpenMP thread count belongs to the calling thread); between measurements (every :data:`INTERVAL_S` at most) it
costs a clock read. Two signals over the last interval:

* **contention**: the time our threads spent runnable but waiting for a CPU (``/proc/self/task/*/schedstat``).
  Above :data:`WAIT_DOWN` CPU-seconds per second, other processes take our cores away: one thread fewer (or as
  many as the CPUs left free, if fewer). Processes of lower priority (nice, autogroups, cgroup weights) hardly
  make us wait, so they do not count;
* **free CPUs**: the machine's busy time (``/proc/stat``) less our own process's CPU time. :data:`PROBE_S` after
  the count last changed, below the cap, we try one thread more, or as many as the CPUs measured free (other
  processes may only be using what we left them), kept unless we then wait. (Waiting that long before going up
  again keeps a process whose own threads compete, e.g. a server's HTTP thread, from flapping between counts.)

The count stays between 1 and the cap: the count in force before (torch's default, one per core, or what
``--num-threads`` / ``torch.set_num_threads`` chose; a change by anyone else becomes the new cap). On a quiet
machine nothing changes. ``SPINWHEEL_THREADS=off`` turns fitting off (torch's count as set); without ``/proc``
(not Linux) it does nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time

ENV = "SPINWHEEL_THREADS"
INTERVAL_S = 0.1  # how often the CPUs are measured (and the thread count re-fitted) at most
WAIT_DOWN = 0.3  # CPU-seconds per second our threads waited for a CPU above which we use one thread fewer
PROBE_S = 5.0  # how long after a change the count may go up again (one more thread tried)
_PROC_STAT = "/proc/stat"
_TASKS = "/proc/self/task"
_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def enabled() -> bool:
    """Whether the thread count is fitted (``SPINWHEEL_THREADS`` unset or not ``off``, on Linux); another value than
    ``auto`` / ``on`` / ``off`` is warned about (and fits)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in ("auto", "on", "off", ""):
        logging.getLogger(__name__).warning("%s=%r is not auto, on or off: the thread count is fitted", ENV, value)
    on = value != "off"
    return on and os.path.exists(_PROC_STAT) and os.path.exists(f"{_TASKS}/{threading.get_native_id()}/schedstat")


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


def next_threads(current: int, cap: int, free: float, wait: float, settled: bool) -> int:
    """The count after an interval in which other processes left ``free`` CPUs and our threads waited ``wait``
    CPU-seconds per second for one; ``settled``: :data:`PROBE_S` have passed since the count last changed."""
    if wait > WAIT_DOWN and current > 1:
        return min(current - 1, threads_for(free, cap))
    if settled and current < cap:
        return max(current + 1, threads_for(free, cap))
    return current


def thread_waits() -> dict[str, int]:
    """Nanoseconds each thread of this process has spent runnable but waiting for a CPU (``schedstat``)."""
    waits = {}
    for tid in os.listdir(_TASKS):
        try:
            fd = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY)
            try:
                waits[tid] = int(os.read(fd, 128).split()[1])
            finally:
                os.close(fd)
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return waits


def waited_seconds(before: dict[str, int], after: dict[str, int]) -> float:
    """Seconds waited between two :func:`thread_waits` samples, by the threads present in both."""
    return sum(max(0, w - before[tid]) for tid, w in after.items() if tid in before) / 1e9


class _State(threading.local):
    """One computing thread's measurements (OpenMP's thread count is per thread)."""

    def __init__(self) -> None:
        self.t: float | None = None
        self.busy = self.own = 0.0
        self.waits: dict[str, int] = {}
        self.cap = self.threads = 0
        self.changed = -PROBE_S  # when the count last changed
        self.cost = 0.0  # seconds the last sample took


_state = _State()


def sample_cpu() -> tuple[float, float, dict[str, int]]:
    """CPU seconds busy machine-wide, CPU seconds of this process and its threads' waits, now."""
    return busy_cpu_seconds(_NICED), time.process_time(), thread_waits()


def fit_threads() -> int | None:
    """Fit this thread's torch threads to what other processes leave (see the module docstring); cheap between
    measurements. Returns the thread count, or ``None`` when fitting is off."""
    if not _ENABLED:
        return None
    st = _state
    now = time.monotonic()
    if st.t is not None and now - st.t < max(INTERVAL_S, 100 * st.cost):  # sampling: at most ~1% of the time
        return st.threads
    import torch

    current = torch.get_num_threads()
    if current != st.threads:  # first call, or someone set the count: that is the cap from now on
        st.cap = st.threads = current
    try:
        busy, own, waits = sample_cpu()
    except (OSError, ValueError):
        return current
    st.cost = time.monotonic() - now  # grows with the process's threads (one schedstat file each)
    if st.t is not None:
        elapsed = now - st.t
        free = free_cpus(busy - st.busy, own - st.own, elapsed, _CPUS, usable_cpus())
        wait = waited_seconds(st.waits, waits) / elapsed
        want = next_threads(current, st.cap, free, wait, now - st.changed >= PROBE_S)
        if want != current:
            torch.set_num_threads(want)
            st.threads, st.changed = want, now
    st.t, st.busy, st.own, st.waits = now, busy, own, waits
    return st.threads


_ENABLED = enabled()
_CPUS = os.cpu_count() or 1  # the CPUs /proc/stat counts
_NICED = hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) > 0
