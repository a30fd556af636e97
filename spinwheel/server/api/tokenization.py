"""``POST /tokenize`` and ``POST /detokenize``, shaped as vLLM's server has them: ``{"count", "max_model_len",
"tokens", "token_strs"}`` for a prompt or for chat messages (rendered exactly as ``/v1/chat/completions`` renders
them, so ``count`` equals that endpoint's ``usage.prompt_tokens``), and ``{"prompt"}`` for token ids (special tokens
kept, so that ``detokenize(tokenize(text))`` gives the tokenizer's view of ``text``)."""

from __future__ import annotations

from spinwheel.models.tokenizer import Tokenizer
from spinwheel.server.api.logprobs import token_text
from spinwheel.server.api.params import ServedModel
from spinwheel.server.api.protocol import DetokenizeRequest, TokenizeRequest
from spinwheel.server.chat_template import MESSAGE_COST_CHARS, ChatRenderer
from spinwheel.server.generation import off_loop


class Tokenization:
    def __init__(self, model: ServedModel, tokenizer: Tokenizer, renderer: ChatRenderer | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.renderer = renderer or ChatRenderer(tokenizer)

    def _tokenize(self, body: TokenizeRequest) -> list[int]:
        if body.messages is not None:
            return self.renderer(body.messages, body.add_generation_prompt, bool(body.add_special_tokens))
        add = True if body.add_special_tokens is None else body.add_special_tokens
        return self.tokenizer.encode(body.prompt or "", add_special_tokens=add)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        if body.model is not None:
            self.model.check_name(body.model)
        size = len(body.prompt or "") + sum(len(m.text()) + MESSAGE_COST_CHARS for m in body.messages or [])
        ids = await off_loop(size, self._tokenize, body)
        strs = [token_text(self.tokenizer, t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        if body.model is not None:
            self.model.check_name(body.model)
        self.model.check_token_ids(body.tokens, "tokens")
        text = await off_loop(len(body.tokens), self.tokenizer.decode, body.tokens, False)
        return {"prompt": text}
