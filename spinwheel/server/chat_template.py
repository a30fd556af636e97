"""A conversation's prompt token ids: the messages rendered with the checkpoint's chat template, then tokenized.

The template writes the special tokens itself (BOS, role markers), so the rendered text is tokenized with special
tokens parsed. A special token's text typed in a message (``<eos>``, ``<|im_end|>``) is then parsed too and becomes
that token: vLLM's server and ``transformers``' ``apply_chat_template(tokenize=True)`` do the same, and it is the
default here. With ``special_tokens_in_content=False`` (``spinwheel serve --no-special-tokens-in-content``) message
content is text only: the spans of the rendered text that are a message's content are tokenized with special
tokens read as plain text, and the template's own text around them as before. A conversation whose messages hold
no special token's text is tokenized exactly as in the default mode.
"""

from __future__ import annotations

from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from spinwheel.models.tokenizer import Tokenizer, TokenizerError
from spinwheel.server.api.protocol import APIError, ChatMessage

# What rendering one message costs, in characters of tokenizing (the template's loop, the role markers): 30,000
# empty messages took 0.5 s to render, so they count toward the size that moves the work off the event loop.
MESSAGE_COST_CHARS = 16


def special_token_texts(tokenizer: Tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens (those the tokenizer parses out of any text it encodes)."""
    return [t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special]


def content_spans(text: str, contents: list[str]) -> list[tuple[int, int]]:
    """Where each of ``contents`` (in order) lies in the rendered ``text``, as (start, end); a template that
    rewrote a message (trimmed it, say) is matched on the trimmed text. A 400 when a content cannot be found."""
    spans, pos = [], 0
    for content in contents:
        for candidate in (content, content.strip()):
            start = text.find(candidate, pos)
            if candidate and start >= 0:
                spans.append((start, start + len(candidate)))
                pos = start + len(candidate)
                break
        else:
            raise APIError(
                400,
                "this chat template rewrites message content, so the special tokens in it cannot be kept as text "
                "(the server runs with --no-special-tokens-in-content): remove them from the messages",
                param="messages",
            )
    return spans


def encode_content_as_text(
    tokenizer: Tokenizer, text_only: HFTokenizer, text: str, contents: list[str], add_special_tokens: bool
) -> list[int]:
    """Tokenize ``text`` with the spans of ``contents`` read as plain text (by ``text_only``, a copy of the
    tokenizer's backend with ``encode_special_tokens``) and the rest with special tokens parsed; the tokenizer's
    post-processor (BOS) applies once, around the whole, when ``add_special_tokens``."""
    backend, pieces, pos = tokenizer.backend, [], 0
    for start, end in content_spans(text, contents):
        if start > pos:
            pieces.append(backend.encode(text[pos:start], add_special_tokens=False))
        pieces.append(text_only.encode(text[start:end], add_special_tokens=False))
        pos = end
    if pos < len(text):
        pieces.append(backend.encode(text[pos:], add_special_tokens=False))
    merged = Encoding.merge(pieces, growing_offsets=True) if pieces else backend.encode("", add_special_tokens=False)
    return backend.post_process(merged, add_special_tokens=add_special_tokens).ids


class ChatRenderer:
    """Messages -> prompt token ids for one tokenizer, with message content parsed for special tokens (the
    default) or read as text only."""

    def __init__(self, tokenizer: Tokenizer, special_tokens_in_content: bool = True) -> None:
        self.tokenizer, self.special_tokens_in_content = tokenizer, special_tokens_in_content
        self._specials = special_token_texts(tokenizer)
        self._text_only: HFTokenizer | None = None  # the backend's copy that reads special tokens as text

    def __call__(
        self, messages: list[ChatMessage], add_generation_prompt: bool, add_special_tokens: bool = False
    ) -> list[int]:
        turns = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
        except TokenizerError as e:
            raise APIError(400, str(e), param="messages") from None
        if not self.special_tokens_in_content:
            marked = [t["content"] for t in turns if any(s in t["content"] for s in self._specials)]
            if marked:
                if self._text_only is None:  # built once; the original stays as it is, others use it meanwhile
                    copy = HFTokenizer.from_str(self.tokenizer.backend.to_str())
                    copy.encode_special_tokens = True
                    self._text_only = copy
                return encode_content_as_text(self.tokenizer, self._text_only, text, marked, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_chat(
    tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, add_special_tokens: bool = False
) -> list[int]:
    """A conversation's prompt token ids, special tokens in message content parsed (the server's default)."""
    return ChatRenderer(tokenizer)(messages, add_generation_prompt, add_special_tokens)
