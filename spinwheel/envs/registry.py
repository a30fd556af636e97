"""``--env`` and ``--env-arg``: the environment a run trains on, as a factory of per-episode instances.

``--env NAME`` picks a built-in (:data:`BUILTINS`), ``--env module:Class`` a user's class (importable from the working
directory or the Python path, as ``--reward module:function`` is), ``--env reasoning-gym:NAME`` a reasoning-gym
dataset. Each ``--env-arg key=value`` becomes a keyword option of the constructor, its value read as a bool
(``true`` / ``false``), an int, a float or else the string itself; ``-`` in a key reads as ``_``.

Everything that can be checked before the run starts is, each failure an :class:`EnvError` of one line naming the
cause and what to do: an unknown name (the built-ins are listed), a module that does not import, a class that is not
an environment (no ``reset`` / ``step``), an option the constructor does not take (its options are listed), and a
constructor that raises — :func:`load_env` builds one train-split instance to find out.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spinwheel.envs.base import Env, EnvError
from spinwheel.envs.calculator import CalculatorEnv
from spinwheel.envs.dataset import DatasetEnv
from spinwheel.envs.guess import GuessEnv
from spinwheel.envs.single import ArithmeticEnv
from spinwheel.user_code import import_user_module, one_line

BUILTINS: dict[str, type[Env]] = {
    "arithmetic": ArithmeticEnv,
    "dataset": DatasetEnv,
    "calculator": CalculatorEnv,
    "guess": GuessEnv,
}
REASONING_GYM = "reasoning-gym:"


def parse_value(text: str) -> bool | int | float | str:
    """An ``--env-arg`` value: ``true`` / ``false``, an int, a float, or the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_env_args(args: Sequence[str]) -> dict[str, Any]:
    """``["key=value", ...]`` as keyword options (see :func:`parse_value`)."""
    options: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise EnvError(f"--env-arg {arg!r}: expected key=value (e.g. --env-arg max_turns=4)")
        if key in options:
            raise EnvError(f"--env-arg {key} given twice; give each option once")
        options[key] = parse_value(value)
    return options


@dataclass
class EnvFactory:
    """Builds the run's environment for one episode: ``factory(split)``; a constructor that raises is an
    :class:`EnvError` naming the environment. ``cls`` (its ``name``, ``max_turns``, ``stop``) and ``options`` are
    what ``--env`` and ``--env-arg`` chose."""

    spec: str
    cls: type[Env]
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self, split: str = "train") -> Env:
        try:
            return self.cls(split=split, **self.options)
        except EnvError as e:
            raise EnvError(f"--env {self.spec}: {e}") from None
        except Exception as e:
            raise EnvError(f"--env {self.spec}: building the environment raised {one_line(e)}") from None


def _user_class(spec: str) -> type[Env]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EnvError(
            f"--env {spec!r}: expected a built-in ({', '.join(BUILTINS)}), module:Class or reasoning-gym:NAME"
        )
    module = import_user_module("--env", spec, module_name, EnvError)
    cls = getattr(module, attr, None)
    if cls is None:
        raise EnvError(f"--env {spec!r}: {module_name} has no class {attr!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        what = f"has no {' / '.join(missing)} method" if missing else "is not a class"
        raise EnvError(
            f"--env {spec!r}: {module_name}.{attr} is not an environment (it {what}); subclass spinwheel.envs.Env"
        )
    return cls


def _check_options(spec: str, cls: type, options: dict[str, Any]) -> None:
    """An option the constructor does not take is an :class:`EnvError` listing those it does."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # takes any option: the constructor checks its own
    known = [n for n, p in params.items() if n != "split" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in options:
        if key not in known:
            shown = ", ".join(known) or "none"
            raise EnvError(f"--env-arg {key}: environment {spec} has no option {key!r} (its options: {shown})")


def env_class(spec: str) -> tuple[type[Env], dict[str, Any]]:
    """The class ``--env spec`` names, and the options the spec itself sets (a reasoning-gym dataset's name)."""
    if spec in BUILTINS:
        return BUILTINS[spec], {}
    if spec.startswith(REASONING_GYM):
        from spinwheel.envs.rgym import ReasoningGymEnv, dataset_options

        name = spec[len(REASONING_GYM) :]
        dataset_options(name)  # an EnvError when reasoning-gym is absent or has no such dataset
        return ReasoningGymEnv, {"dataset": name}
    if ":" not in spec:
        raise EnvError(
            f"--env {spec}: no built-in environment {spec!r}; the built-ins: {', '.join(BUILTINS)} "
            "(or module:Class, reasoning-gym:NAME)"
        )
    return _user_class(spec), {}


def load_env(spec: str, args: Sequence[str] = (), answer_extraction: str = "auto") -> EnvFactory:
    """The factory of ``--env spec`` with ``--env-arg`` ``args``, checked by building one train-split instance.
    ``answer_extraction`` (``--answer-extraction``, reasoning-gym only) is its ``answer_extraction`` option unless
    an ``--env-arg`` sets it."""
    cls, fixed = env_class(spec)
    options = parse_env_args(args)
    if fixed.keys() & options.keys():
        raise EnvError(f"--env-arg {sorted(fixed.keys() & options.keys())[0]}: set by --env {spec} itself")
    if answer_extraction != "auto":
        if not spec.startswith(REASONING_GYM):
            raise EnvError(f"--answer-extraction acts for --env reasoning-gym:NAME, not --env {spec}")
        if options.get("answer_extraction", answer_extraction) != answer_extraction:
            raise EnvError("--answer-extraction and --env-arg answer_extraction disagree; give one of them")
        options["answer_extraction"] = answer_extraction
    _check_options(spec, cls, options)
    factory = EnvFactory(spec, cls, {**fixed, **options})
    factory("train")
    return factory
