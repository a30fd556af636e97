"""The built-in char tokenizer, HF tokenizer.json loading and chat templates."""

import json

import pytest
import transformers  # the reference implementation (a test dependency)

from spinwheel.models.tokenizer import CHAR_ALPHABET, Tokenizer, TokenizerError, load_tokenizer


def test_char_level_round_trip_and_specials():
    tok = Tokenizer.char_level()
    assert tok.vocab_size == 100
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "12+34=46\n hello, World!"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == len(text) + 1
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False).startswith("<bos>")
    assert tok.encode_batch([text, "7"]) == [ids, tok.encode("7")]
    assert tok.encode("é", add_special_tokens=False) == [3]  # unknown characters map to <unk>
    assert len({tok.encode(c, add_special_tokens=False)[0] for c in CHAR_ALPHABET}) == len(CHAR_ALPHABET)


def test_saved_tokenizer_loads_in_tokenizers_and_transformers(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer

    tok = Tokenizer.char_level()
    tok.save_pretrained(tmp_path)
    text = "3-15=-12 ok"
    assert RustTokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids == tok.encode(text)
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert fast.encode(text) == tok.encode(text)  # both prepend BOS
    assert fast.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert fast.decode(tok.encode(text), skip_special_tokens=True) == text
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (1, 2, 0)
    back = Tokenizer.from_pretrained(tmp_path)
    assert back.encode(text) == tok.encode(text) and back.chat_template == tok.chat_template
    messages = [{"role": "user", "content": "2+2="}]
    assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        messages
    )


def test_hf_tokenizer_json_checkpoint(tmp_path):
    """A BPE tokenizer built with the tokenizers library, saved as a HF checkpoint, loads through spinwheel."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rust = RustTokenizer(models.BPE(unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(
        ["hello world", "the quick brown fox"] * 50,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    rust.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {
                    "__type": "AddedToken",
                    "content": "<s>",
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                },
                "eos_token": "</s>",
                "chat_template": template,
            }
        )
    )
    tok = load_tokenizer(tmp_path)
    assert tok.bos_id == rust.token_to_id("<s>") and tok.eos_id == rust.token_to_id("</s>")
    assert tok.pad_id == tok.eos_id  # no pad token: pad with EOS
    assert tok.decode(tok.encode("hello world fox")) == "hello world fox"
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (
        tok.apply_chat_template(msgs, add_generation_prompt=False)
        == fast.apply_chat_template(msgs, tokenize=False)
        == "<s>[system] be brief</s>[user] hi</s>"
    )


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot be parsed"):
        Tokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.char_level()
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(TokenizerError, match="only user turns"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="no chat_template"):
        tok.apply_chat_template([])


def test_a_checkpoint_without_tokenizer_json(tmp_path, caplog):
    """No tokenizer file: the built-in char tokenizer, said in a warning; a tokenizer in another form
    (sentencepiece's tokenizer.model, GPT-2's vocab.json + merges.txt): one line saying how to write tokenizer.json,
    never a silent char tokenizer that drops what it cannot spell."""
    with caplog.at_level("WARNING", logger="spinwheel.models.tokenizer"):
        assert load_tokenizer(tmp_path).vocab_size == Tokenizer.char_level().vocab_size
    assert f"{tmp_path} has no tokenizer.json: using the built-in character tokenizer" in caplog.text
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TokenizerError, match=r"tokenizer as tokenizer.model but no tokenizer.json.*save_pretrained"):
        load_tokenizer(tmp_path)
