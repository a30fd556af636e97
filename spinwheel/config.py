"""Typed config dataclasses become command-line options.

Every field of a config dataclass is an option ``--field-name``; its help text is the field's
``metadata["help"]`` (use :func:`option`). Booleans become ``--flag / --no-flag``; a choice may also take a value
when given alone (``bare=``) and a ``--no-`` form (``negated=``), so a flag that grew modes keeps its old spelling.
Validation stays in each dataclass's ``__post_init__``, so a bad value from the command line fails with the same
message as one from code.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text for the CLI (``default`` may be a factory via ``default_factory=``)."""
    if "default_factory" in kwargs:
        return dataclasses.field(default_factory=kwargs.pop("default_factory"), metadata={"help": help, **kwargs})
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def _base_type(tp: Any) -> tuple[Any, bool]:
    """Strip ``X | None`` / ``Optional[X]``; returns (X, optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


class _Flag(argparse.BooleanOptionalAction):
    """``--flag / --no-flag`` whose help keeps the text it is given (Python < 3.14 appends its own default, which
    would show it twice)."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, help=help, **kwargs)
        self.help = help


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add one option per field of dataclass ``cls`` to ``parser`` (except the fields named in ``skip``, which
    :func:`from_args` then leaves at their defaults); ``defaults`` overrides fields' defaults by name."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().split("\n")[0])
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False or f.name in skip:
            continue
        tp, optional = _base_type(hints[f.name])
        name = "--" + prefix + f.name.replace("_", "-")
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )  # type: ignore[misc]
        default = (defaults or {}).get(f.name, default)
        help_text = f.metadata.get("help", "")
        # A help text that explains its own default, or a None default (unset), shows no "(default: ...)".
        shown = help_text if default is None or "default" in help_text else f"{help_text} (default: {default!r})"
        dest = prefix.replace("-", "_") + f.name
        if tp is bool:
            group.add_argument(name, dest=dest, action=_Flag, default=default, help=shown)
        elif typing.get_origin(tp) in (list, tuple):
            (inner, *_) = typing.get_args(tp) or (str,)
            group.add_argument(name, dest=dest, type=inner, nargs="*", default=default, help=shown)
        elif typing.get_origin(tp) is typing.Literal:
            choices = list(typing.get_args(tp))
            # metadata "bare": the value of the option given alone (``--remat``); "negated": of ``--no-<name>``.
            bare = {"nargs": "?", "const": f.metadata["bare"]} if "bare" in f.metadata else {}
            group.add_argument(
                name, dest=dest, type=type(choices[0]), choices=choices, default=default, help=shown, **bare
            )
            if "negated" in f.metadata:
                negated = f.metadata["negated"]
                no = "--" + prefix + "no-" + f.name.replace("_", "-")
                group.add_argument(no, dest=dest, action="store_const", const=negated, help=f"{name} {negated}")
        else:
            conv = tp if tp in (int, float, str) else str
            group.add_argument(
                name,
                dest=dest,
                type=conv,
                default=default,
                help=shown,
                metavar=None if not optional else conv.__name__.upper(),
            )


def from_args(cls: type[T], ns: argparse.Namespace, prefix: str = "") -> T:
    """Build ``cls`` from the parsed options that :func:`add_arguments` added."""
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        dest = prefix.replace("-", "_") + f.name
        if f.init and hasattr(ns, dest):
            value = getattr(ns, dest)
            if isinstance(value, list) and isinstance(f.default, tuple):
                value = tuple(value)
            kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ValueError as e:
        if not prefix:
            raise
        raise ValueError(_flag_names(str(e), cls, ns, prefix)) from None


def _flag_names(message: str, cls: type, ns: argparse.Namespace, prefix: str) -> str:
    """``message`` with the field names of ``cls`` that are command-line options here spelled as those options
    (``max_num_seqs`` -> ``--engine-max-num-seqs``): the user typed the flag, not the field."""
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "_" in f.name and hasattr(ns, prefix.replace("-", "_") + f.name):
            flag = "--" + prefix + f.name.replace("_", "-")
            message = re.sub(rf"(?<![\w-]){f.name}(?!\w)", flag, message)
    return message
