"""Commands made of one typed config and one function: ``spinwheel NAME`` parses the config's options
(:func:`spinwheel.config.add_arguments`) and calls the function with it. A new command of that shape is one row
here; commands with options of their own (sft, the RL family, serve, classic, envs) are built in :mod:`spinwheel.cli`.

Each row: name -> (one-line help, ``"module:ConfigClass"``, ``"module:function"``). Modules are imported only when
their command is parsed or run, so a row costs nothing at start-up.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from spinwheel.config import add_arguments, from_args

COMMANDS: dict[str, tuple[str, str, str]] = {
    "merge": (
        "fold a LoRA adapter into its base: a plain HF checkpoint",
        "spinwheel.merge:MergeConfig",
        "spinwheel.merge:run_merge",
    ),
    "convert": (
        "a GGUF model as a plain HF checkpoint",
        "spinwheel.convert:ConvertConfig",
        "spinwheel.convert:run_convert",
    ),
    "tinker": (
        "the Tinker training API (the official tinker SDK) over one base model: LoRA clients batched together",
        "spinwheel.tinker.serve:TinkerConfig",
        "spinwheel.tinker.serve:run_tinker",
    ),
    "plot": (
        "the curves of one or more runs (their metrics.jsonl) in one PNG, runs overlaid",
        "spinwheel.plot:PlotConfig",
        "spinwheel.plot:run_plot",
    ),
}


def _load(ref: str) -> Any:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def add_parsers(sub: argparse._SubParsersAction, running: str | None) -> None:
    """A sub-parser per row; a row's options only when every command is listed or it is the one running."""
    for name, (what, config, _) in COMMANDS.items():
        if running not in (None, name):
            sub.add_parser(name, help=what, add_help=False)
            continue
        cls = _load(config)
        add_arguments(sub.add_parser(name, help=what, description=cls.__doc__), cls)


def run(ns: argparse.Namespace) -> int | None:
    """Run ``ns.command`` when it is a row here; returns its exit status (0 when the function returns another
    value), or None when the command is not one of these."""
    if ns.command not in COMMANDS:
        return None
    _, config, fn = COMMANDS[ns.command]
    status = _load(fn)(from_args(_load(config), ns))
    return status if isinstance(status, int) and not isinstance(status, bool) else 0
