"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM at a step that every rank agrees on, with a checkpoint.

A signal only sets a flag; the loop finishes the step it is in. Once per step every rank calls
:meth:`StopOnSignal.agreed`, which all-reduces the flag (max over the world) under ``torchrun``: torchrun forwards a
Ctrl-C to its workers one after another, so they notice it in different steps, and the all-reduce makes all of them
stop after the same one, write the (sharded) checkpoint together and exit with 128 + the signal number (130 for
SIGINT), as a shell reports a process ended by that signal. A second SIGINT raises :class:`KeyboardInterrupt` at
once: quit without saving.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from spinwheel.parallel.run_group import run_group

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Raised once the checkpoint of an interrupted run is written; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} at step {step}")
        self.signum, self.step = signum, step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _flag_device() -> torch.device:
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StopOnSignal:
    """While entered (main thread only), SIGINT and SIGTERM set :attr:`signum` instead of ending the process; the
    previous handlers come back on exit. ``distributed``: the flag is agreed over the default process group."""

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
                signal.siginterrupt(sig, False)  # restart system calls it lands in (a collective's socket reads)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: the user does not want to wait for the checkpoint
        self.signum = signum

    def agreed(self) -> int | None:
        """The signal any rank received so far, the same on every rank (a collective under torchrun: every rank
        calls it once per step); ``None``: keep going."""
        return self.agree(False)[0]

    def agree(self, failed: bool) -> tuple[int | None, bool]:
        """(:meth:`agreed`'s signal, whether any rank's ``failed`` is true) in one collective under torchrun."""
        if not self.distributed:
            return self.signum, failed
        flags = torch.tensor([self.signum or 0, int(failed)], dtype=torch.int64, device=_flag_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=run_group())
        return int(flags[0].item()) or None, bool(flags[1].item())

    @staticmethod
    def interrupted(signum: int, step: int, ckpt_dir: Path, is_main: bool, resumable: bool = True) -> Interrupted:
        """The exception to raise after the checkpoint of ``step`` was written; the main rank says so first
        (``resumable``: whether rerunning the command resumes, i.e. the run was not started with --no-resume)."""
        if is_main:
            print(
                f"interrupted: checkpoint saved at step {step} in {ckpt_dir}"
                + ("; rerun the same command to resume" if resumable else ""),
                flush=True,
            )
        return Interrupted(signum, step)


def any_rank(flag: bool, distributed: bool) -> bool:
    """Whether ``flag`` is true on any rank (a collective under torchrun: every rank calls it at the same point)."""
    if not distributed:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=_flag_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=run_group())
    return bool(t.item())
