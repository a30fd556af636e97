"""Typed config dataclasses become command-line options.

Every field of a config dataclass is an option ``--field-name``; its help text is the field's
``metadata["help"]`` (use :func:`option`). Booleans become ``--flag / --no-flag``; a choice may also take a value
when given alone (``bare=``) and a ``--no-`` form (``negated=``), so a flag that grew modes keeps its old spelling.
A field's ``group=`` places it under one of the shared :data:`GROUPS` of ``--help``, which say what options are
for whatever dataclass holds them. Validation stays in each dataclass's ``__post_init__`` (the range checks every
config makes through :func:`check_ranges`), so a bad value from the command line fails with the same message as one
from code. :func:`redefault` gives a subclass other defaults for the fields it inherits.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

# The option groups of a command's --help, in this order (title: what its options are for). A group no option of
# the command names is not shown.
GROUPS = {
    "model and data": "what is trained and on what",
    "rollout": "what the policy samples for each update",
    "algorithm": "the objective and the algorithm's own options",
    "optimizer": "the optimizer, its learning-rate schedule and its batches",
    "run": "length, evaluation and checkpoints, resume, placement, logging",
    "parallel layout": "under torchrun (spinwheel launch --nproc-per-node N)",
    "engine": "the paged-attention engine that samples",
}
_parser_groups: weakref.WeakKeyDictionary[argparse.ArgumentParser, dict[str, Any]] = weakref.WeakKeyDictionary()


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text for the CLI (``default`` may be a factory via ``default_factory=``);
    ``group=`` names its :data:`GROUPS` entry."""
    if "default_factory" in kwargs:
        return dataclasses.field(default_factory=kwargs.pop("default_factory"), metadata={"help": help, **kwargs})
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def redefault(**values: Any) -> Callable[[type[T]], type[T]]:
    """Class decorator, under ``@dataclass``: the inherited fields named get these defaults in the subclass (a value
    made with :func:`option` also replaces the help text), keeping their type, help, group and place."""

    def apply(cls: type[T]) -> type[T]:
        annotations = cls.__dict__.get("__annotations__", {})
        for name, value in values.items():
            base = next((b for b in cls.__mro__[1:] if name in getattr(b, "__dataclass_fields__", {})), None)
            if base is None:
                raise TypeError(f"{cls.__name__}: no inherited field {name!r} to give a default")
            inherited = base.__dataclass_fields__[name]  # type: ignore[attr-defined]
            new = value if isinstance(value, dataclasses.Field) else dataclasses.field(default=value)
            default = {"default": new.default} if new.default_factory is dataclasses.MISSING else {}
            factory = {} if default else {"default_factory": new.default_factory}
            metadata = {**inherited.metadata, **new.metadata}
            annotations[name] = typing.get_type_hints(base)[name]
            setattr(cls, name, dataclasses.field(**default, **factory, metadata=metadata))  # type: ignore[call-overload]
        cls.__annotations__ = annotations
        return cls

    return apply


def flag(name: str) -> str:
    """The option of field ``name``: ``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + name.replace("_", "-")


def check_ranges(
    config: Any,
    *,
    at_least_1: Iterable[str] = (),
    non_negative: Iterable[str] = (),
    positive: Iterable[str] = (),
    unit_interval: Iterable[str] = (),
    open_unit_interval: Iterable[str] = (),
    fraction: Iterable[str] = (),
    name: Callable[[str], str] = flag,
    ge: str = ">=",
    error: type[Exception] = ValueError,
) -> None:
    """Raise ``error("<name> must be <range>, got <value>")`` for the first field of ``config`` outside its range:
    ``at_least_1`` (``>= 1``), ``non_negative`` (``>= 0``), ``positive`` (``> 0``), ``unit_interval`` (``[0, 1]``),
    ``open_unit_interval`` (``(0, 1)``), ``fraction`` (``(0, 1]``). A field that is None (unset) passes. ``name``
    spells a field in the message (default: its option), ``ge`` the sign of ``>=``."""
    ranges: list[tuple[Iterable[str], Callable[[Any], bool], str]] = [
        (at_least_1, lambda v: v >= 1, f"{ge} 1"),
        (non_negative, lambda v: v >= 0, f"{ge} 0"),
        (positive, lambda v: v > 0, "> 0"),
        (unit_interval, lambda v: 0 <= v <= 1, "in [0, 1]"),
        (open_unit_interval, lambda v: 0 < v < 1, "in (0, 1)"),
        (fraction, lambda v: 0 < v <= 1, "in (0, 1]"),
    ]
    for fields, within, shown in ranges:
        for field in fields:
            value = getattr(config, field)
            if value is not None and not within(value):
                raise error(f"{name(field)} must be {shown}, got {value}")


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


def _shared_group(parser: argparse.ArgumentParser, title: str) -> Any:
    """The :data:`GROUPS` entry ``title`` of ``parser`` (all of them made on first use, so they show in order)."""
    if title not in GROUPS:
        raise ValueError(f"unknown option group {title!r}: one of {', '.join(GROUPS)}")
    if parser not in _parser_groups:
        _parser_groups[parser] = {t: parser.add_argument_group(t) for t in GROUPS}
    group = _parser_groups[parser][title]
    group.description = GROUPS[title]  # only now: a group without options or description is not shown
    return group


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    group: str | None = None,
) -> None:
    """Add one option per field of dataclass ``cls`` to ``parser`` (except the fields named in ``skip``, which
    :func:`from_args` then leaves at their defaults); ``defaults`` overrides fields' defaults by name. Each option
    goes to its field's group, else to ``group``, else to a group of its own for ``cls``."""
    hints = typing.get_type_hints(cls)
    own_group = None
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False or f.name in skip:
            continue
        title = f.metadata.get("group", group)
        if title is None and own_group is None:
            summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())  # the first paragraph, whole
            own_group = parser.add_argument_group(cls.__name__, summary)
        target = own_group if title is None else _shared_group(parser, title)
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )  # type: ignore[misc]
        _add_option(target, f, hints[f.name], prefix, (defaults or {}).get(f.name, default))


def _add_option(group: Any, f: dataclasses.Field, hint: Any, prefix: str, default: Any) -> None:
    """The option of field ``f`` (type ``hint``) in ``group``."""
    tp, optional = _base_type(hint)
    name = "--" + prefix + f.name.replace("_", "-")
    help_text = f.metadata.get("help", "")
    # A help text that explains its own default, or a None default (unset), shows no "(default: ...)".
    shown = help_text if default is None or "default" in help_text else f"{help_text} (default: {default!r})"
    dest = prefix.replace("-", "_") + f.name
    if f.metadata.get("positional"):  # a list of operands: ``spinwheel plot DIR [DIR ...]``
        (inner, *_) = typing.get_args(tp) or (str,)
        group.add_argument(dest, type=inner, nargs="*", default=default, help=shown, metavar=f.name.upper())
    elif tp is bool:
        group.add_argument(name, dest=dest, action=_Flag, default=default, help=shown)
    elif typing.get_origin(tp) in (list, tuple) and f.metadata.get("repeat"):  # --x a b --x c: (a, b, c)
        (inner, *_) = typing.get_args(tp) or (str,)
        group.add_argument(name, dest=dest, type=inner, nargs="+", action="extend", default=None, help=shown)
    elif typing.get_origin(tp) in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (str,)
        group.add_argument(name, dest=dest, type=inner, nargs="*", default=default, help=shown)
    elif typing.get_origin(tp) is typing.Literal:
        choices = list(typing.get_args(tp))
        # metadata "bare": the value of the option given alone (``--remat``); "negated": of ``--no-<name>``.
        bare = {"nargs": "?", "const": f.metadata["bare"]} if "bare" in f.metadata else {}
        group.add_argument(name, dest=dest, type=type(choices[0]), choices=choices, default=default, help=shown, **bare)
        if "negated" in f.metadata:
            negated = f.metadata["negated"]
            no = "--" + prefix + "no-" + f.name.replace("_", "-")
            group.add_argument(no, dest=dest, action="store_const", const=negated, help=f"{name} {negated}")
    else:
        conv = tp if tp in (int, float, str) else str
        metavar = None if not optional else conv.__name__.upper()
        group.add_argument(name, dest=dest, type=conv, default=default, help=shown, metavar=metavar)


def from_args(cls: type[T], ns: argparse.Namespace, prefix: str = "") -> T:
    """Build ``cls`` from the parsed options that :func:`add_arguments` added."""
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        dest = prefix.replace("-", "_") + f.name
        if f.init and hasattr(ns, dest):
            value = getattr(ns, dest)
            if value is None and f.metadata.get("repeat"):
                continue  # not given: the field's default
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
