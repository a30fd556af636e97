"""Code a user names on the command line (``--reward module:function``, ``--env module:Class``): imported from the
working directory or the Python path, as ``python -m`` would find a module beside the user's data; every failure
becomes one line naming the option. A thread such code leaves running cannot keep the program from exiting
(:func:`exit_despite_threads`)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType


def one_line(error: BaseException) -> str:
    """``Type: message`` on one line, at most 300 characters of message."""
    text = " ".join(str(error).split())[:300]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def import_user_module(flag: str, spec: str, module_name: str, error: type[Exception]) -> ModuleType:
    """Import ``module_name`` for ``flag spec``; any failure, ``SystemExit`` at import included, is ``error``."""
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        return importlib.import_module(module_name)
    except BaseException as e:  # a bad module is a bad option, not the end of the run
        if isinstance(e, KeyboardInterrupt):
            raise
        raise error(f"{flag} {spec!r}: cannot import {module_name!r} ({one_line(e)})") from None


EXIT_GRACE_S = 2.0  # how long threads still running when a command is done may take to end before it exits anyway


def _lingering() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]


def exit_despite_threads(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """``main(argv)``, the exit status of the ``spinwheel`` program, which threads user code left running (non-daemon
    threads, which the interpreter waits for at exit) cannot keep alive: if any is still running
    :data:`EXIT_GRACE_S` after the command is done, a warning names them and the process exits with the command's
    status, without waiting for them."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        _watch_exit(code, argv)
        raise
    except BaseException as e:  # the traceback is printed at exit, then the same watch
        _watch_exit(130 if isinstance(e, KeyboardInterrupt) else 1, argv)
        raise
    _watch_exit(code, argv)
    return code


def _watch_exit(code: int, argv: list[str]) -> None:
    if not _lingering():
        return

    def watch() -> None:
        time.sleep(EXIT_GRACE_S)  # meanwhile the interpreter shuts down: executors stop their idle workers
        if names := ", ".join(repr(t.name) for t in _lingering()):
            command = " ".join(["spinwheel", *argv[:1]])
            print(
                f"{command}: warning: exiting with {names} still running (a non-daemon thread started by user "
                "code: an environment, agent or reward function); make it a daemon thread or end it",
                file=sys.stderr,
            )
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)

    threading.Thread(target=watch, name="spinwheel-exit-watch", daemon=True).start()
