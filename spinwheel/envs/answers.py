"""Answer extraction for scoring: the part of a model's reply a task's checker compares with the reference.

A chat model answers in sentences ("5 - 3 = 2. The answer is 2."), while reasoning-gym's ``score_answer`` compares
the string it is given with the reference answer (exact: 1.0; the reference inside a longer string: partial credit
``len(answer) / len(string)``). So the reply is cut down to its answer first, by one of :data:`EXTRACTIONS`:

============== =================================================================================================
``last-number`` the last number in the reply (``-12``, ``3.5``, ``1,234`` read as ``1234``; ``2.50`` written ``2.5``
                and ``4.0`` written ``4``, as the reference answers write them); None when there is none
``answer-tag``  the content of the last ``<answer>…</answer>`` (reasoning-gym's own ``extract_answer``
                convention and its system prompts'); None when there is no tag
``boxed``       the content of the last ``\\boxed{…}`` (braces balanced); None when there is none
``tag-or-text`` the last ``<answer>`` tag's content when the reply has one, else the whole reply (stripped)
``none``        the whole reply, stripped (what spinwheel scored before extraction existed)
============== =================================================================================================

``auto`` picks per task (:func:`auto_extraction`): a task whose reference answers are all numbers reads the last
number of the reply; any other task reads ``tag-or-text``. A reply with nothing to extract is scored as None
(reasoning-gym scores None 0.0).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # "-" a sign, not "5-3"'s minus
_NUMERIC = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)  # reasoning_gym.utils.extract_answer's


def canonical_number(text: str) -> str:
    """``text`` (a number as :func:`last_number` finds it) without thousands separators, trailing decimal zeros or
    a trailing decimal point: ``"1,234.50"`` → ``"1234.5"``, ``"4.0"`` → ``"4"``, ``"-0"`` → ``"0"``."""
    text = text.replace(",", "")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def last_number(text: str) -> str | None:
    """The last number in ``text``, canonical (:func:`canonical_number`), or None."""
    found = _NUMBER.findall(text)
    return canonical_number(found[-1]) if found else None


def answer_tag(text: str) -> str | None:
    """The stripped content of the last ``<answer>…</answer>`` in ``text``, or None (as reasoning-gym's
    ``extract_answer``)."""
    found = list(_ANSWER_TAG.finditer(text))
    return found[-1].group(1).strip() if found else None


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` in ``text`` (nested braces kept), or None when there is none or it
    is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip()
            depth -= 1
    return None


def tag_or_text(text: str) -> str:
    """The last ``<answer>`` tag's content, else the whole reply stripped."""
    tagged = answer_tag(text)
    return text.strip() if tagged is None else tagged


def whole_text(text: str) -> str:
    return text.strip()


Extractor = Callable[[str], "str | None"]

EXTRACTIONS: dict[str, Extractor] = {
    "last-number": last_number,
    "answer-tag": answer_tag,
    "boxed": boxed,
    "tag-or-text": tag_or_text,
    "none": whole_text,
}
CHOICES: tuple[str, ...] = ("auto", *EXTRACTIONS)


def is_numeric(answer: object) -> bool:
    """Whether a reference answer is a number written plainly (``-28``, ``3.5``)."""
    return isinstance(answer, (str, int, float)) and _NUMERIC.fullmatch(str(answer).strip()) is not None


def auto_extraction(answers: Iterable[object]) -> str:
    """The extraction ``auto`` picks for a task with these reference answers: ``last-number`` when every one is a
    number, else ``tag-or-text``."""
    answers = list(answers)
    return "last-number" if answers and all(is_numeric(a) for a in answers) else "tag-or-text"


def extractor(name: str) -> Extractor:
    """The extraction function called ``name`` (not ``auto``: resolve it with :func:`auto_extraction` first)."""
    if name not in EXTRACTIONS:
        raise ValueError(f"answer extraction must be one of {', '.join(CHOICES)}, got {name!r}")
    return EXTRACTIONS[name]
