"""Output text a few tokens at a time, and the stop strings checked on it as it grows.

Decoding a sequence's whole output after every step costs O(t) per step, O(t^2) per request. An
:class:`IncrementalDetokenizer` decodes only a short window per step, the way vLLM's incremental detokenizer does with
its prefix and read offsets: ``ids[prefix:read]`` is the piece of text emitted last (decoded again as context, since
decoders such as SentencePiece's Metaspace drop a leading space of the first token they see, and byte-level BPE needs
the bytes before a character's continuation), ``ids[prefix:]`` the same piece plus the new tokens. The difference of
the two decodes is the new text; while it ends in U+FFFD (a multi-byte character whose remaining bytes are still to
come) nothing is emitted and the offsets stay, so the text streamed equals the decode of all ids at once.
``tokenizers`` >= 0.21 does the same in Rust (``DecodeStream``), which is used when it is there.

:class:`OutputText` adds the request's stop strings (and ``min_tokens``) on top: the engine uses it for offline and
in-process serving, the API process for an engine in its own process; both therefore cut the same text at the same
token.
"""

from __future__ import annotations

from spinwheel.engine.sampling_params import SamplingParams
from spinwheel.models.tokenizer import Tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the windows are decoded in Python
    DecodeStream = None


class IncrementalDetokenizer:
    """Token ids -> text, the new ids of each step at a time (``push``); ``flush`` at the end emits what a last,
    incomplete character still holds back (as U+FFFD, as a full decode would).

    With ``tokenizers`` >= 0.21 the windows are decoded by its ``DecodeStream`` (the same offsets, in Rust: one call
    per token instead of two decodes); ``native=False`` (or an older ``tokenizers``) decodes them here."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, native: bool | None = None) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix = 0  # token_ids[_prefix:_read] decode to the end of ``text``: context for the next ones
        self._read = 0  # token_ids[:_read] are in ``text``
        native = DecodeStream is not None if native is None else native
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if native else None
        self._held = False  # native: the last token gave no text (held back, or a special token skipped)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        ids = self.token_ids
        if self._read == len(ids):
            return ""
        context = self._decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        window = self._decode(ids[self._prefix :])
        if len(window) <= len(context) or (window.endswith("\ufffd") and not final):
            return ""  # nothing printable yet (a special token skipped, or a character still incomplete)
        new = window[len(context) :]
        self._prefix, self._read = self._read, len(ids)
        self.text += new
        return new

    def push(self, token_ids: list[int]) -> str:
        """Add ``token_ids``; returns the text they complete (possibly empty)."""
        self.token_ids += token_ids
        if self._stream is None:
            return self._advance(final=False)
        step, backend, new = self._stream.step, self.tokenizer.backend, ""
        for token in token_ids:
            piece = step(backend, token)
            self._held = piece is None
            if piece is not None:
                new += piece
        self.text += new
        return new

    def flush(self) -> str:
        """The output is complete: emit what is held back."""
        if self._stream is None:
            return self._advance(final=True)
        if not self._held:
            return ""
        self._held = False
        full = self._decode(self.token_ids)  # once per output, and only when its last token gave no text
        new = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += new
        return new


class OutputText:
    """One sample's output text and its stop-string check (what ``SamplingParams`` asks: ``stop``,
    ``include_stop_str_in_output``, ``min_tokens``, ``skip_special_tokens``).

    A stop string is looked for where it would end in the new text of a step (from ``len(stop) - 1`` characters
    before it), once the output holds ``min_tokens`` tokens, as vLLM does: one split across tokens or
    steps is found at the token that completes it, and one that ended before ``min_tokens`` is not, so the text
    streamed before never has to be taken back. The earliest match wins (ties: the smaller string)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stop = [s for s in params.stop or [] if s]  # type: ignore[union-attr]
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_reason: str | None = None
        self.text = ""

    @property
    def num_tokens(self) -> int:
        return len(self.detokenizer.token_ids)

    def append(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Add the tokens of a step and check the stop strings (unless ``check_stop`` is False: a token that ended
        the output itself, EOS or a stop token). Returns the stop string hit, after which ``text`` is cut and
        further tokens are ignored; else None."""
        if self.stop_reason is not None:
            return None
        before = len(self.text)
        if not self.detokenizer.push(token_ids):
            return None
        self.text = text = self.detokenizer.text
        if not check_stop or not self.stop or self.num_tokens < self.min_tokens:
            return None
        hits = [(pos, s) for s in self.stop if (pos := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        self.text = text[: pos + len(stop)] if self.include_stop else text[:pos]
        self.stop_reason = stop
        return stop

    def finish(self) -> str:
        """The output ended (not by a stop string): its whole text."""
        if self.stop_reason is None:
            self.detokenizer.flush()
            self.text = self.detokenizer.text
        return self.text

    def sync(self, token_ids: list[int], start: int, check_stop: bool = True) -> str | None:
        """Catch up with a sequence's ``token_ids`` whose output begins at ``start`` (the prompt's length): append
        the ids not seen yet. For the engine, which keeps the ids on the sequence."""
        seen = start + self.num_tokens
        if len(token_ids) == seen:
            return None
        return self.append(token_ids[seen:], check_stop)
