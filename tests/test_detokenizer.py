"""Incremental detokenization and stop strings (issue 12 item 13): the text decoded a few tokens at a time equals the
decode of all the ids at once, on the built-in tokenizer (what the `small` preset and the demo checkpoint use) and
on a byte-level BPE whose tokens split multi-byte characters; stop strings cut the text where a naive search of the
whole text decoded after every token cuts it, also when they straddle tokens and steps, with
``include_stop_str_in_output`` and ``min_tokens`` (a stop string that ended before min_tokens does not count, as in
vLLM); and the engine decodes O(new tokens) per step, not the whole output again."""

import pytest
from helpers import long_context_model
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import spinwheel
from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.engine.detokenizer import IncrementalDetokenizer, OutputText
from spinwheel.models.tokenizer import Tokenizer, load_tokenizer

CHAR = load_tokenizer("small")  # the built-in character tokenizer, a real `tokenizers` one


def _byte_bpe() -> Tokenizer:
    """A byte-level BPE trained here on text with 2-, 3- and 4-byte characters: merges make tokens of whole
    characters, and the 256 byte tokens split them."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld ñandú", "日本語のテキスト", "emoji 🙂🚀 and more 🙂", "plain ascii text here"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    return Tokenizer(backend, "<bos>", "<eos>", "<pad>")


BPE = _byte_bpe()


def _chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("native", [True, False], ids=["DecodeStream", "python"])
@pytest.mark.parametrize("tok", [CHAR, BPE], ids=["char", "byte-bpe"])
@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_incremental_decode_equals_the_full_decode(tok, native, data, skip):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    cuts = data.draw(st.lists(st.integers(0, 40), max_size=12))
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, native=native)
    streamed = ""
    for chunk in _chunks(ids, cuts):
        streamed += detok.push(chunk)
        assert detok.text == streamed
    full = tok.decode(ids, skip_special_tokens=skip)
    # what is still held back at the end is an incomplete character (and what came with it), never more
    assert full.startswith(streamed) and (full == streamed or full.endswith("\ufffd"))
    streamed += detok.flush()
    assert streamed == detok.text == full


@pytest.mark.parametrize("native", [True, False], ids=["DecodeStream", "python"])
def test_a_character_split_over_tokens_is_held_until_complete(native):
    ids = BPE.encode("🙂", add_special_tokens=False)
    ((mapped, _),) = BPE.backend.pre_tokenizer.pre_tokenize_str("🚀")  # its 4 bytes as byte-level symbols
    byte_ids = [BPE.backend.token_to_id(c) for c in mapped]  # one token per byte
    assert len(byte_ids) == 4 and BPE.decode(byte_ids[:2]).endswith("\ufffd")
    detok = IncrementalDetokenizer(BPE, native=native)
    assert [detok.push([i]) for i in byte_ids] == ["", "", "", "🚀"]
    assert detok.push(ids) == "🙂"
    # an output that ends inside a character: the full decode's U+FFFD comes out at the end
    assert detok.push(byte_ids[:2]) == "" and detok.flush() == "\ufffd"
    assert detok.text == BPE.decode(byte_ids + ids + byte_ids[:2])


def _naive_stop(tok, ids: list[int], params: SamplingParams) -> tuple[str, int | None, str | None]:
    """The reference: after each token from min_tokens on, decode everything and list every occurrence of every stop
    string that ends in the text this token added; the earliest (then the smaller string) cuts the text. Returns
    (text, tokens kept, stop string). The text is that of the longest run of tokens whose decode does not end
    inside a character (U+FFFD), which is never streamed."""
    skip = params.skip_special_tokens
    complete, prev = 0, ""
    for n in range(1, len(ids) + 1):
        if not tok.decode(ids[:n], skip_special_tokens=skip).endswith("\ufffd"):
            complete = n
        text = tok.decode(ids[:complete], skip_special_tokens=skip)
        if n >= params.min_tokens:
            hits = [
                (p, s)
                for s in params.stop
                for p in range(len(text) - len(s) + 1)
                if s and text[p : p + len(s)] == s and p + len(s) > len(prev)
            ]
            if hits:
                pos, stop = min(hits)
                return (text[: pos + len(stop)] if params.include_stop_str_in_output else text[:pos]), n, stop
        prev = text
    return tok.decode(ids, skip_special_tokens=skip), None, None


@pytest.mark.parametrize("tok", [CHAR, BPE], ids=["char", "byte-bpe"])
@settings(max_examples=150, deadline=None)
@given(data=st.data(), include=st.booleans(), skip=st.booleans())
def test_stop_strings_cut_where_a_whole_text_search_cuts(tok, data, include, skip):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=30))
    full = tok.decode(ids, skip_special_tokens=skip)
    # stop strings taken from the text itself (so they hit, often across tokens), plus one that never does
    picks = data.draw(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 4)), min_size=1, max_size=3))
    stops = [full[a % max(1, len(full)) :][:k] for a, k in picks] + ["\x00never"]
    min_tokens = data.draw(st.integers(0, len(ids)))
    params = SamplingParams(
        stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens, max_tokens=64, skip_special_tokens=skip
    )
    out = OutputText(tok, params)
    kept, stop = None, None
    for n, token in enumerate(ids, 1):
        stop = out.append([token])
        if stop is not None:
            kept = n
            break
    text = out.text if stop is not None else out.finish()
    assert (text, kept, stop) == _naive_stop(tok, ids, params)


def test_a_stop_string_straddling_steps_and_min_tokens():
    ids = CHAR.encode("abcXYdefXYZ", add_special_tokens=False)
    out = OutputText(CHAR, SamplingParams(stop=["XYZ", "cX"], min_tokens=5))
    found = [out.append([t]) for t in ids]
    # "cX" completes at token 4, before min_tokens: it does not count; "XYZ" straddles tokens 9-11
    assert found == [None] * 10 + ["XYZ"] and out.text == "abcXYdef"
    out = OutputText(CHAR, SamplingParams(stop=["XYZ"], include_stop_str_in_output=True))
    found = [out.append([t]) for t in ids]
    assert found.index("XYZ") == 10 and out.text == "abcXYdefXYZ"


class _CountingTokenizer(Tokenizer):
    """The built-in tokenizer, counting how many token ids it decodes."""

    def __init__(self) -> None:
        base = Tokenizer.char_level()
        super().__init__(base.backend, base.bos_token, base.eos_token, base.pad_token, base.chat_template)
        self.num_decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.num_decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("stream", [True, False])
def test_the_engine_decodes_only_the_new_tokens_of_each_step(stream):
    """300 tokens with a stop string that never hits: the engine decodes O(t) ids in all, not O(t^2) (the whole
    output again every step is 45,150 ids)."""
    tok = _CountingTokenizer()
    engine = LLMEngine(long_context_model(), tok, EngineConfig(num_kv_blocks=256))
    engine.add_request("r", [1, 5, 6], SamplingParams(max_tokens=300, ignore_eos=True, stop=["\x00"], temperature=0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step(stream=stream)
    (final,) = [o for o in outs if o.finished]
    assert len(final.outputs[0].token_ids) == 300
    assert final.outputs[0].text == spinwheel.Tokenizer.char_level().decode(final.outputs[0].token_ids)
    assert tok.num_decoded < 5 * 300
    if stream:  # every step's cumulative text is the decode of its tokens
        for o in outs:
            assert o.outputs[0].text == CHAR.decode(o.outputs[0].token_ids)
