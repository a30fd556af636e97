"""One run owns its output directory: an exclusive lock on ``<out_dir>/.spinwheel.lock`` for as long as the run
lives.

Two commands writing one ``--out-dir`` would interleave ``metrics.jsonl`` rows and overwrite each other's
checkpoints. The lock is an ``flock`` on a file in the directory: the kernel drops it when its process ends, however
it ends, so a lock left by a killed run is never stale (the next run takes it); the file keeps the holder's pid
for the message a second run prints, and a run that ends removes it. Under ``torchrun`` rank 0 holds it for the
whole job.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks; the directory is not guarded
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".spinwheel.lock"


class RunDirError(ValueError):
    """The output directory cannot be used (a file, or held by another run); the message names the fix."""


def prepare_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` (and its parents); an ``out_dir`` that is a file is refused in one line."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"--out-dir {out_dir} is a file; choose a directory")
    out_dir.mkdir(parents=True, exist_ok=True)  # a parent that is a file: OSError "Not a directory", naming the path


class RunDirLock:
    """The exclusive lock on a run directory; :meth:`acquire` raises :class:`RunDirError` naming the holder's pid."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        prepare_out_dir(self.out_dir)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if fcntl is None:
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise RunDirError(
                    f"--out-dir {self.out_dir} is in use by another run (pid {holder}); wait for it to end or "
                    "choose another --out-dir"
                ) from None
            try:  # the holder before us may have removed the file after we opened it: lock the file that is there
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file (a finished run leaves no trace) and drop the lock."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:  # gone, or the directory turned unwritable: a stale file is harmless (the lock is flock's)
            pass  # and raising here would hide the error the run is stopping on
        if fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
