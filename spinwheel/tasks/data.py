"""JSONL readers for user data: SFT, RL (prompt + verifiable answer) and preference pairs.

One JSON object per line; blank lines are skipped and unknown keys are ignored. Every problem is reported
as one line in compiler style, ``path:line: what is wrong``, so a bad record in a large file can be found
and fixed without reading the reader's code:

- SFT:        ``{"prompt": str, "completion": str}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``
              (roles system / user / assistant; the last message is the assistant's reply to train on)
- RL:         ``{"prompt": str, "answer": str | int}`` or ``{"messages": [...], "answer": ...}`` (the conversation so
              far, ending with the user's turn; rendered with the checkpoint's chat template)
- preference: ``{"prompt": str, "chosen": str, "rejected": str}``

Small samples of each format ship in :data:`SAMPLES_DIR`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLES_DIR = Path(__file__).parent / "samples"

ROLES: tuple[str, ...] = ("system", "user", "assistant")

_SFT_FORMATS = '(expected {"prompt", "completion"} or {"messages"})'


class DataError(ValueError):
    """A malformed data file; the message names the file, the line and the field."""


@dataclass
class SFTRecord:
    """One SFT example: either ``prompt`` + ``completion`` or a chat ``messages`` list ending with the assistant."""

    prompt: str | None = None
    completion: str | None = None
    messages: list[dict[str, str]] | None = None

    def __post_init__(self) -> None:
        if self.messages is None:
            if self.prompt is None or self.completion is None:
                raise ValueError("SFTRecord needs prompt and completion, or messages")
        elif self.prompt is not None or self.completion is not None:
            raise ValueError("SFTRecord takes prompt and completion, or messages, not both")
        elif not self.messages or self.messages[-1].get("role") != "assistant":
            raise ValueError("SFTRecord messages must be non-empty and end with an assistant message")


@dataclass
class RLRecord:
    """One RL prompt with the verifiable answer its completions are rewarded against."""

    prompt: str | None
    answer: str
    messages: list[dict[str, str]] | None = None  # instead of prompt: rendered with the chat template


@dataclass
class PreferenceRecord:
    """One preference pair: ``chosen`` is preferred over ``rejected`` as a completion of ``prompt``."""

    prompt: str
    chosen: str
    rejected: str


def _type_name(value: Any) -> str:
    # JSON's names where Python's read oddly in a data error (NoneType, dict, str).
    return {type(None): "null", dict: "object", str: "string"}.get(type(value), type(value).__name__)


def _read_objects(path: str | os.PathLike[str]) -> list[tuple[str, dict[str, Any]]]:
    """(location prefix ``path:line``, object) for each non-blank line of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}" if not path.exists() else f"not a file: {path}")
    rows = []
    # Binary read, decoded per line, so an encoding error is reported with its line number as well.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                # utf-8-sig on the first line drops the byte-order mark some Windows editors write.
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {_type_name(obj)}")
            rows.append((where, obj))
    if not rows:
        raise DataError(f"{path}: no records (the file is empty or blank)")
    return rows


def _string(where: str, obj: dict[str, Any], key: str, expected: str) -> str:
    if key not in obj:
        raise DataError(f"{where}: missing field '{key}' {expected}")
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' must be a string, got {_type_name(value)}")
    return value


def _messages(where: str, value: Any, last_role: str = "assistant") -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else _type_name(value)
        raise DataError(f'{where}: field \'messages\' must be a non-empty list of {{"role", "content"}}, got {got}')
    messages = []
    for i, message in enumerate(value):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{where}: field '{name}' must be an object, got {_type_name(message)}")
        role = _string(where, message, "role", f"in '{name}'")
        content = _string(where, message, "content", f"in '{name}'")
        if role not in ROLES:
            raise DataError(f"{where}: field '{name}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != last_role:
        why = "the reply to train on" if last_role == "assistant" else "the turn the policy answers"
        raise DataError(
            f"{where}: field 'messages[{len(messages) - 1}].role' must be {last_role!r} "
            f"(the last message is {why}), got {messages[-1]['role']!r}"
        )
    return messages


def read_sft_jsonl(path: str | os.PathLike[str]) -> list[SFTRecord]:
    """SFT records from ``{"prompt", "completion"}`` or ``{"messages"}`` lines (the two may be mixed)."""
    records = []
    for where, obj in _read_objects(path):
        if "messages" in obj:
            both = [key for key in ("prompt", "completion") if key in obj]
            if both:
                raise DataError(
                    f"{where}: field '{both[0]}' given together with 'messages'; use one format {_SFT_FORMATS}"
                )
            records.append(SFTRecord(messages=_messages(where, obj["messages"])))
        else:
            prompt = _string(where, obj, "prompt", _SFT_FORMATS)
            completion = _string(where, obj, "completion", _SFT_FORMATS)
            records.append(SFTRecord(prompt=prompt, completion=completion))
    return records


def read_rl_jsonl(path: str | os.PathLike[str]) -> list[RLRecord]:
    """RL records from ``{"prompt", "answer"}`` or ``{"messages", "answer"}`` lines (the messages end with the
    user's turn); an integer answer is kept as its decimal text."""
    expected = '(expected {"prompt", "answer"} or {"messages", "answer"})'
    records = []
    for where, obj in _read_objects(path):
        messages = None
        if "messages" in obj:
            if "prompt" in obj:
                raise DataError(f"{where}: field 'prompt' given together with 'messages'; use one format {expected}")
            messages, prompt = _messages(where, obj["messages"], last_role="user"), None
        else:
            prompt = _string(where, obj, "prompt", expected)
        if "answer" not in obj:
            raise DataError(f"{where}: missing field 'answer' {expected}")
        answer = obj["answer"]
        # bool is an int subclass in Python, but `true` is no answer to a prompt.
        if isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise DataError(f"{where}: field 'answer' must be a string or an integer, got {_type_name(answer)}")
        records.append(RLRecord(prompt=prompt, answer=answer, messages=messages))
    return records


def read_preference_jsonl(path: str | os.PathLike[str]) -> list[PreferenceRecord]:
    """Preference pairs from ``{"prompt", "chosen", "rejected"}`` lines."""
    expected = '(expected {"prompt", "chosen", "rejected"})'
    records = []
    for where, obj in _read_objects(path):
        prompt, chosen, rejected = (_string(where, obj, key, expected) for key in ("prompt", "chosen", "rejected"))
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not value.strip():
                raise DataError(f"{where}: field '{key}' is empty (a preference pair needs two completions)")
        if chosen == rejected:
            raise DataError(f"{where}: fields 'chosen' and 'rejected' are the same text (the pair prefers nothing)")
        records.append(PreferenceRecord(prompt=prompt, chosen=chosen, rejected=rejected))
    return records


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> None:
    """Write one JSON object per line (UTF-8, non-ASCII kept as is), replacing ``path``."""
    with Path(path).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
