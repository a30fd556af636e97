"""Peak resident memory (RSS) of the phases of a step — generation, log-probs, update — without disturbing the
process's own peak.

Linux keeps the process's high-water mark of its resident set (``VmHWM`` in ``/proc/self/status``, what
``getrusage`` and ``/usr/bin/time -v`` report). It can be reset (``echo 5 > /proc/self/clear_refs``), but a reset
also lowers what ``getrusage`` and ``/usr/bin/time`` report at exit — a run would hide its own peak — so this
module never resets it. A phase's peak is instead:

* exactly ``VmHWM`` when the high-water mark rose during the phase (the phase set a new process peak, allocations
  freed inside it included — what a sample before and after would miss);
* else the largest RSS a sampler thread read (``/proc/self/statm``, every ``interval_s``) during the phase, and at its
  end — a lower bound that can miss spikes shorter than the interval, below the process's peak anyway.

Without ``/proc`` (not Linux) the phase figures are the process's peak so far (``getrusage``), an upper bound.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_STATUS = Path("/proc/self/status")
_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_peak_gb() -> float:
    """The process's peak RSS since it started, in GB (10⁹ bytes): ``VmHWM``, or ``getrusage`` without ``/proc``."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage / 1e9 if sys.platform == "darwin" else usage * 1024 / 1e9  # macOS: bytes; Linux: KiB


def current_rss_gb() -> float | None:
    """The process's resident set now, in GB (None without ``/proc``)."""
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE / 1e9
    except (OSError, ValueError, IndexError):
        return None


def release_free_memory() -> bool:
    """Hand the allocator's free memory back to the kernel (glibc's ``malloc_trim(0)``; False where there is none).

    The activations of a step are many tensors of a few MB, under glibc's (dynamic, up to 32 MiB) mmap threshold:
    they come from the heap, and once freed stay resident — the next phase (generation) would carry the update's
    peak. Trimming after the update returns them; it takes milliseconds."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


class _Sampler(threading.Thread):
    """Reads the RSS every ``interval_s`` until stopped; ``peak`` is the largest read (None without ``/proc``)."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.interval_s, self.stopped, self.peak = interval_s, threading.Event(), current_rss_gb()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            now = current_rss_gb()
            if now is not None and (self.peak is None or now > self.peak):
                self.peak = now

    def stop(self) -> float | None:
        self.stopped.set()
        self.join()
        now = current_rss_gb()
        return now if self.peak is None or (now is not None and now > self.peak) else self.peak


class PhasePeaks:
    """Peak RSS per named phase of a step, as ``rss_peak_<phase>_gb`` figures (see the module docstring)::

        peaks = PhasePeaks()
        with peaks.phase("gen"):
            ...
        record.update(peaks.figures())  # {"rss_peak_gen_gb": ..., "rss_peak_gb": ...}

    A phase entered twice before :meth:`figures` keeps the larger peak; ``rss_peak_gb`` is the process's peak since
    it started. Phases may not nest (the outer one's figure would be the inner one's too).
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self.peaks: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = process_peak_gb()
        sampler = _Sampler(self.interval_s)
        sampler.start()
        try:
            yield
        finally:
            sampled, after = sampler.stop(), process_peak_gb()
            # The kernel updates VmHWM lazily (at unmaps), so a rise seen during this phase may be an earlier
            # phase's peak recorded late: it is this phase's only if the sampler saw RSS come near it here.
            rose_here = after > before and (sampled is None or sampled >= after - 0.25 * (after - before) - 0.05)
            peak = after if rose_here or sampled is None else sampled
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)

    def figures(self) -> dict[str, float]:
        """The phases' peaks since the last call, and the process's peak; clears the phases."""
        out = {f"rss_peak_{name}_gb": round(gb, 4) for name, gb in self.peaks.items()}
        out["rss_peak_gb"] = round(process_peak_gb(), 4)
        self.peaks = {}
        return out
