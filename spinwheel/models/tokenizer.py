"""Tokenizers: one :class:`Tokenizer` over the Hugging Face ``tokenizers`` library, for both the built-in
character-level vocabulary and any HF ``tokenizer.json`` checkpoint, plus chat templates rendered with jinja2 the
way ``transformers`` renders them (sandboxed, ``trim_blocks``/``lstrip_blocks``).

The built-in tokenizer is saved as a real ``tokenizer.json`` + ``tokenizer_config.json``, so ``tokenizers`` and
``transformers.PreTrainedTokenizerFast`` load it beside a spinwheel checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Printable ASCII (95) plus newline; with the four specials the built-in vocabulary has 100 tokens.
CHAR_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
# A minimal chat template for the built-in model (role tags in plain characters). Like HF templates it writes
# the BOS token itself, so rendered chats are encoded with ``add_special_tokens=False``.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


logger = logging.getLogger(__name__)
# A checkpoint's tokenizer in a form other than tokenizer.json (sentencepiece, GPT-2 BPE files): not read here.
OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "spiece.model", "vocab.txt")


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded, or a template that cannot be rendered."""


def _token_text(tok: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as ``{"content": ...}`` objects."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """Text <-> token ids, special-token ids and chat rendering."""

    def __init__(
        self,
        backend: HFTokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template
        self.bos_id = self._id(bos_token)
        self.eos_id = self._id(eos_token)
        self.pad_id = self._id(pad_token)
        if self.pad_id is None:  # common for HF checkpoints: pad with EOS (it is masked out anyway)
            self.pad_id = self.eos_id if self.eos_id is not None else 0

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return tid

    # ---- construction ----
    @classmethod
    def char_level(cls, alphabet: str = CHAR_ALPHABET) -> Tokenizer:
        """The built-in character tokenizer: ids 0..3 are <pad>, <bos>, <eos>, <unk>; then one id per character."""
        vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK])}
        for ch in alphabet:
            vocab.setdefault(ch, len(vocab))
        backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([PAD, BOS, EOS, UNK])
        # Like Llama's tokenizers: encoding with special tokens prepends BOS.
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
        )
        return cls(backend, BOS, EOS, PAD, DEFAULT_CHAT_TEMPLATE)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json`` / ``special_tokens_map.json`` when present)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{tok_file}: no tokenizer.json in {path} (spinwheel reads the 'tokenizers' "
                "format; convert slow tokenizers with transformers first)"
            )
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust library raises a plain Exception
            raise TokenizerError(f"{tok_file}: cannot be parsed by the tokenizers library ({e})") from None
        cfg: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            f = path / name
            if f.is_file():
                try:
                    cfg.update(json.loads(f.read_text()))
                except json.JSONDecodeError as e:
                    raise TokenizerError(f"{f}: invalid JSON ({e})") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(
            backend,
            _token_text(cfg.get("bos_token")),
            _token_text(cfg.get("eos_token")),
            _token_text(cfg.get("pad_token")),
            template,
        )

    def save_pretrained(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": UNK if self.backend.token_to_id(UNK) is not None else None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(
            json.dumps({k: v for k, v in cfg.items() if v is not None}, indent=2) + "\n"
        )

    # ---- use ----
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the tokenizer's post-processor adds what the model
        expects around a prompt (BOS for the built-in and Llama-style tokenizers), as ``transformers`` does."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the checkpoint's chat template (jinja2, sandboxed, as transformers does)."""
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat_template (add one to tokenizer_config.json)")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise TokenizerError(f"chat template cannot be rendered: {e}") from None


def load_tokenizer(path_or_preset: str | os.PathLike) -> Tokenizer:
    """A checkpoint directory's (or Hub id's, see :mod:`~spinwheel.models.hub`) tokenizer, or the built-in char
    tokenizer for presets / directories without one. A PEFT adapter directory without a tokenizer of its own has its
    base's."""
    from spinwheel.models.hub import resolve_model_path
    from spinwheel.models.lora_io import adapter_base, is_adapter_dir

    path = Path(resolve_model_path(path_or_preset))
    for _ in range(16):  # down a chain of adapters (bounded: one that loops back is the model loader's error)
        if not is_adapter_dir(path) or (path / "tokenizer.json").is_file():
            break
        path = Path(resolve_model_path(adapter_base(path)))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_pretrained(path)
    if path.is_dir() and (other := [n for n in OTHER_TOKENIZER_FILES if (path / n).is_file()]):
        raise TokenizerError(
            f"{path} has its tokenizer as {', '.join(other)} but no tokenizer.json, the form spinwheel reads: "
            "write one with transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
        )
    if path.is_dir():  # e.g. save_pretrained without a tokenizer: say so, characters outside its alphabet are dropped
        logger.warning("%s has no tokenizer.json: using the built-in character tokenizer", path)
    return Tokenizer.char_level()


__all__ = ["Tokenizer", "TokenizerError", "load_tokenizer", "CHAR_ALPHABET", "DEFAULT_CHAT_TEMPLATE"]
