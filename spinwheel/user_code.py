"""Code a user names on the command line (``--reward module:function``, ``--env module:Class``): imported from the
working directory or the Python path, as ``python -m`` would find a module beside the user's data; every failure
becomes one line naming the option."""

from __future__ import annotations

import importlib
import sys
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
