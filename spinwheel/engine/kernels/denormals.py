"""Denormal flushing scoped to a block: an engine step runs with the engine's setting, its caller keeps its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _denormals_flushed() -> bool:
    # torch has no getter: a computation whose result is denormal yields 0 exactly when flushing is on
    return (torch.tensor([1e-30]) * 1e-10).item() == 0.0


@contextlib.contextmanager
def flush_denormal(enabled: bool) -> Iterator[None]:
    """Flush denormals to zero inside the block, restoring the caller's setting afterwards."""
    if not enabled or _denormals_flushed():
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
