"""Rate-limited logging for the server: a flood of one failure (a client hammering a broken path, ``accept()``
running out of descriptors) must not become hundreds of MB of identical lines."""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_KEYS = 1024  # distinct messages remembered (the oldest is forgotten first)


class RepeatFilter(logging.Filter):
    """Let a warning or error through once per ``interval_s``; count the repeats in between and report the count
    on the next one let through. A repeat is a record from the same logger at the same level whose message starts
    with the same first line (so ``"accept failed: %s"`` with other arguments, or asyncio's multi-line reports
    that name a different socket each time, are repeats). Records below WARNING always pass."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._seen: OrderedDict[tuple[str, int, str], list] = OrderedDict()  # key -> [time let through, repeats]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:200])
        now = self.clock()
        state = self._seen.get(key)
        if state is not None and now - state[0] < self.interval_s:
            state[1] += 1
            return False
        if state is not None and state[1]:
            record.msg = f"{record.msg} [{state[1]} more like this in the last {now - state[0]:.0f} s]"
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_KEYS:
            self._seen.popitem(last=False)
        return True


def install_repeat_filter(interval_s: float) -> RepeatFilter:
    """Filter every handler of the root and uvicorn loggers (call after uvicorn configured its logging). Without a
    root handler, one writing WARNING and above to stderr is added, so that asyncio's and spinwheel's reports are
    filtered too."""
    repeat = RepeatFilter(interval_s)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(name)s: %(message)s"))
        root.addHandler(handler)
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            if repeat not in handler.filters:
                handler.addFilter(repeat)
    return repeat
