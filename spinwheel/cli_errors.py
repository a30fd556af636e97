"""The CLI's answers to bad command lines, each one line naming the cause and what to do: argparse errors without
the usage block, options no parser took (with a close match), a reward model given where a policy is needed."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import select
import sys
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: ``spinwheel <command>: error: ...`` naming where the options are
    listed (argparse's own prints the usage block first, tens of lines for a training command); under torchrun only
    rank 0 prints, as for every other bad option."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} ('{self.prog} --help' lists the options)\n")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        super().exit(status, message if int(os.environ.get("RANK", "0")) == 0 else None)


def unknown_options(parser: argparse.ArgumentParser, ns: argparse.Namespace, extra: list[str]) -> None:
    """Options no parser took: refused by the command's own parser (its name in the line, a close match when one
    of its options looks like a typo of it) instead of the top-level parser's ``spinwheel: error``."""
    sub = parser
    while True:  # down to the innermost command parser (``spinwheel envs expert``)
        actions = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(ns, actions[0].dest, None) if actions else None
        if name is None or name not in actions[0].choices:
            break
        sub = actions[0].choices[name]
    known = [o for a in sub._actions for o in a.option_strings if a.help != argparse.SUPPRESS]
    hints = []
    for opt in extra:
        close = difflib.get_close_matches(opt.split("=")[0], known, n=1, cutoff=0.8) if opt.startswith("--") else []
        hints += [f"{opt}: did you mean {close[0]}?"] if close else []
    sub.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))


def check_policy_checkpoint(ns: argparse.Namespace) -> None:
    """A reward-model checkpoint (a score head, no LM head) given as ``--model`` where a policy is sampled from or
    trained: one line before anything loads (the trainer would fail deep in its loss, the engine produce nothing)."""
    model = getattr(ns, "model", None)
    if ns.command in ("dpo", "rm", "merge") or not model or not (Path(model) / "config.json").is_file():
        return  # dpo says it itself, rm may go on from one; presets, Hub ids and adapters fail on their own
    from spinwheel.models.hf import load_config

    if load_config(model).num_labels is not None:
        where = "; a reward model goes in --reward-model" if hasattr(ns, "reward_model") else ""
        raise ValueError(
            f"--model {model} is a reward model (a score head, no LM head): {ns.command} needs a policy checkpoint "
            f"such as runs/sft/checkpoint{where}"
        )


def out_of_memory(error: BaseException) -> str | None:
    """An allocation the machine refused (CPU: ``DefaultCPUAllocator: can't allocate memory``; CUDA:
    ``OutOfMemoryError``) as one line with the size asked for and what to lower; None for any other error."""
    text = str(error)
    if "can't allocate memory" not in text and type(error).__name__ != "OutOfMemoryError":
        return None
    asked = re.search(r"allocate (\d+) bytes", text)
    size = f" ({int(asked.group(1)) / 2**30:.1f} GiB asked for)" if asked else ""
    first = " ".join(text.split("\n")[0].split())[:200] if not asked else "the allocator refused"
    return (
        f"out of memory{size}: {first}; lower the sizes (--batch-size, --engine-num-kv-blocks or "
        "--engine-kv-cache-memory-mb, --max-tokens, the model)"
    )


def stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (``| head``); if so it now goes to /dev/null, so that
    nothing more is written there, the interpreter's last flush included."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):  # Linux/macOS: the write end errs
            return False
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    except (OSError, ValueError, AttributeError):  # no descriptor behind it, or no poll() here
        return False
    return True
