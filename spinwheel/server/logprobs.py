"""The engine's per-token log-probabilities (``{token_id: logprob}`` per generated token) in the two shapes the
OpenAI API returns them: the legacy completions object (parallel lists) and the chat ``content`` list."""

from __future__ import annotations

from spinwheel.models.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's own text, special tokens spelled out (so that the pieces of an output join to its text)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], offset: int
) -> dict:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for ``token_ids``; ``offset`` is the
    character position of the first token in the choice's text (earlier chunks of a stream came before it)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(token_ids, logprobs):
        s = token_text(tokenizer, t)
        tokens.append(s)
        token_lps.append(lp.get(t))
        tops.append({token_text(tokenizer, k): v for k, v in sorted(lp.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}`` with the ``k`` most likely tokens."""
    content = []
    for t, lp in zip(token_ids, logprobs):
        s = token_text(tokenizer, t)
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        content.append(
            {
                "token": s,
                "logprob": lp.get(t),
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": token_text(tokenizer, i), "logprob": v, "bytes": list(token_text(tokenizer, i).encode())}
                    for i, v in top
                ],
            }
        )
    return {"content": content}
