"""The engine's log-probabilities in the shapes the OpenAI API (and vLLM's extension) return them: the legacy
completions object (parallel lists, also for the echoed prompt), the chat ``content`` list, and vLLM's
``prompt_logprobs`` (per prompt position ``{token id: {"logprob", "rank", "decoded_token"}}``, None for the first).

The engine gives per position ``{token_id: logprob}``: the top k it was asked for plus the token itself (which may
rank below them); None where there is no distribution (a prompt's first token). A log-prob that is not a finite
number (a broken model's NaN, a token masked to -inf) is sent as JSON can carry it (:func:`wire`): -inf as vLLM's
-9999.0, NaN as null, so no response holds ``NaN`` or ``Infinity``, which JSON does not have.
"""

from __future__ import annotations

import math

from spinwheel.models.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # what -inf is sent as (vLLM's floor)


def wire(logprob: float | None) -> float | None:
    """A log-prob as JSON carries it: finite ones as they are, -inf as :data:`MIN_LOGPROB`, NaN (and +inf) as None."""
    if logprob is None or math.isfinite(logprob):
        return logprob
    return MIN_LOGPROB if logprob < 0 else None


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's own text, special tokens spelled out (so that the pieces of an output join to its text)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (token, logprob) of one position, best first (rank ``i + 1`` at index ``i``): the
    engine's top k of at least ``k``, plus the position's own token, which sorts after them unless among them."""
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[dict[int, float] | None],
    offset: int,
    k: int,
    echoed: bool = False,
) -> dict:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for ``token_ids`` with the ``k`` best
    alternatives (and the token itself) per position; ``offset`` is the character position of the first token in
    the choice's text. A position without a distribution (an echoed prompt's first token) has null entries.
    ``echoed``: the tokens of a prompt echoed as the client sent it, where special tokens the tokenizer added
    (BOS) take no room in the text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(token_ids, logprobs):
        s = token_text(tokenizer, t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(tokenizer.decode([t]) if echoed else s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(wire(lp.get(t)))
        best = {token_text(tokenizer, i): v for i, v in top(lp, k)}
        best.setdefault(s, lp[t])
        tops.append({text: wire(v) for text, v in sorted(best.items(), key=lambda kv: -kv[1])})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def concat_logprobs(first: dict, second: dict) -> dict:
    """Two legacy logprobs objects as one (an echoed prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs(
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    logprobs: list[dict[int, float] | None],
    ranks: list[int | None],
    k: int,
) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position the token itself (with its rank in the distribution) and
    the ``k`` most likely tokens (ranks 1..k); None for the first position."""
    out: list[dict[str, dict] | None] = []
    for token, lp, rank in zip(prompt_ids, logprobs, ranks):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": wire(lp[token]), "rank": rank, "decoded_token": token_text(tokenizer, token)}}
        for r, (t, v) in enumerate(top(lp, k)):
            entry.setdefault(str(t), {"logprob": wire(v), "rank": r + 1, "decoded_token": token_text(tokenizer, t)})
        out.append(entry)
    return out


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}`` with the ``k`` most likely tokens."""
    content = []
    for t, lp in zip(token_ids, logprobs):
        s = token_text(tokenizer, t)
        content.append(
            {
                "token": s,
                "logprob": wire(lp.get(t)),
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": (text := token_text(tokenizer, i)), "logprob": wire(v), "bytes": list(text.encode())}
                    for i, v in top(lp, k)
                ],
            }
        )
    return {"content": content}
