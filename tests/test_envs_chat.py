"""--chat / --system-prompt (spinwheel/envs/chat.py): raw-text episodes rendered with a ChatML template, token
for token as transformers' apply_chat_template renders them; observations as user turns; --chat off as before; and
TRL's conversational JSONL form."""

from __future__ import annotations

import json
import random

import pytest

from spinwheel.engine import LLM
from spinwheel.envs.base import Action, Env, Step
from spinwheel.envs.chat import ChatFormat, resolve_chat
from spinwheel.models import Transformer
from spinwheel.models.presets import preset_config
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.rl.llm.episode_tokens import EpisodeConfig
from spinwheel.rl.llm.episodes import EpisodeGroup, run_episodes
from spinwheel.tasks.data import DataError, read_rl_jsonl, read_sft_jsonl

CHATML = (  # SmolLM2-Instruct's template, its default system message shortened
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Smol<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chatml_tokenizer() -> Tokenizer:
    """A byte-pair tokenizer with ChatML's special tokens and template (as SmolLM2's: no BOS added by encode)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE(unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    words = ["system", "user", "assistant", "answer", "the", "is", "guess", "Be", "brief", "Calculate", "="]
    corpus = [" ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(6)) for _ in range(300)]
    backend.train_from_iterator(corpus, trainer)
    return Tokenizer(backend, "<|im_start|>", "<|im_end|>", "<|im_end|>", CHATML)


def hf_tokenizer(tok: Tokenizer):
    """transformers' fast tokenizer over the same backend and template: the reference renderer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok.backend, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=CHATML
    )


def hf_ids(tok: Tokenizer, messages: list[dict[str, str]], generation: bool = True) -> list[int]:
    ids = hf_tokenizer(tok).apply_chat_template(messages, tokenize=True, add_generation_prompt=generation)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def make_llm(tok: Tokenizer) -> LLM:
    model = Transformer(preset_config("test", vocab_size=tok.vocab_size)).init_weights(seed=3, std=0.1).eval()
    return LLM(model, tok, seed=0, max_model_len=256)


class TwoTurnEnv(Env):
    """Raw text: the problem, then one raw-text observation, then done."""

    max_turns = 2

    def reset(self, seed: int) -> str:
        self.turns = 0
        return f"Calculate {seed}+{seed}="

    def step(self, action: Action) -> Step:
        self.turns += 1
        self.last = action.text
        return Step(None, 1.0, True) if self.turns == 2 else Step(f"={2 * 7}\n", 0.0, False)


def play(tok: Tokenizer, chat: ChatFormat | None, record_prompts: list | None = None):
    llm = make_llm(tok)
    if record_prompts is not None:  # every request's prompt tokens, as the engine received them
        add = llm.engine.add_request

        def recording_add(request_id, prompt, params):
            record_prompts.append(list(prompt))
            add(request_id, prompt, params)

        llm.engine.add_request = recording_add
    envs = [TwoTurnEnv() for _ in range(2)]
    config = EpisodeConfig(max_new_tokens=5, temperature=1.0, chat=chat)
    return envs, run_episodes(llm.engine, [EpisodeGroup(envs, 7, 0)], config, seed=0, step=0)


def test_first_observation_is_rendered_as_transformers_renders_the_conversation():
    tok = chatml_tokenizer()
    _, episodes = play(tok, ChatFormat("Be brief."))
    expected = hf_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 7+7="}])
    assert tok.decode(expected, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    for e in episodes:
        assert e.token_ids[: e.prompt_len] == expected
    _, episodes = play(tok, ChatFormat())  # no system prompt: the template's own default system message
    assert episodes[0].token_ids[: episodes[0].prompt_len] == hf_ids(
        tok, [{"role": "user", "content": "Calculate 7+7="}]
    )
    assert tok.decode(episodes[0].token_ids[: episodes[0].prompt_len], skip_special_tokens=False).startswith(
        "<|im_start|>system\nYou are Smol<|im_end|>\n"
    )


def test_observations_are_user_turns_and_the_trainer_gets_exactly_the_engines_tokens():
    tok = chatml_tokenizer()
    prompts: list[list[int]] = []
    envs, episodes = play(tok, ChatFormat("Be brief."), prompts)
    im_end = tok.eos_id
    for env, e in zip(envs, episodes):
        assert not e.failed and e.num_turns == 2 and e.reward == 1.0
        start, end = e.prompt_len, e.turn_ends[0] + 1  # turn 1's sampled tokens
        turn = e.token_ids[start:end]
        num_fed = e.mask[end:].index(1)  # the observation: the tokens before turn 2's first sampled one
        fed = e.token_ids[end : end + num_fed]
        closing = "" if turn[-1] == im_end else "<|im_end|>"  # a turn cut at its token budget is closed by the env
        assert (
            tok.decode(fed, skip_special_tokens=False)
            == closing + "\n<|im_start|>user\n=14\n<|im_end|>\n<|im_start|>assistant\n"
        )
        # the whole history up to turn 2 is the conversation transformers renders, with turn 1 as the model wrote it
        conversation = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Calculate 7+7="},
            {"role": "assistant", "content": e.turn_texts[0]},
            {"role": "user", "content": "=14\n"},
        ]
        history = e.token_ids[: end + len(fed)]
        assert tok.decode(history, skip_special_tokens=False) == tok.decode(
            hf_ids(tok, conversation), skip_special_tokens=False
        )
        assert history in prompts  # turn 2's request was exactly these tokens: what the trainer trains on
        assert e.mask[start:end] == [1] * len(turn) and e.mask[end : end + len(fed)] == [0] * len(fed)


def test_chat_off_keeps_raw_text_and_auto_follows_the_template():
    tok = chatml_tokenizer()
    _, episodes = play(tok, None)
    assert episodes[0].token_ids[: episodes[0].prompt_len] == tok.encode("Calculate 7+7=")
    fed = [
        t
        for t, m in zip(episodes[0].token_ids[episodes[0].prompt_len :], episodes[0].mask[episodes[0].prompt_len :])
        if m == 0
    ]
    assert tok.decode(fed, skip_special_tokens=False) == "=14\n"
    assert resolve_chat("auto", tok) == ChatFormat() and resolve_chat("on", tok, "S") == ChatFormat("S")
    assert resolve_chat("off", tok) is None
    char = Tokenizer.char_level()  # the built-in model's minimal template does not count: make demo stays raw
    assert resolve_chat("auto", char) is None and resolve_chat("on", char) == ChatFormat()
    tok.chat_template = None
    assert resolve_chat("auto", tok) is None
    with pytest.raises(ValueError, match="--chat on: this model's tokenizer has no chat template"):
        resolve_chat("on", tok)
    with pytest.raises(ValueError, match="--system-prompt needs chat rendering: drop --chat off"):
        resolve_chat("off", chatml_tokenizer(), "S")
    with pytest.raises(ValueError, match="give --chat on, or drop --system-prompt"):
        resolve_chat("auto", char, "S")
    from spinwheel.rl.llm import RLConfig
    from spinwheel.train.sft.sft_config import SFTConfig

    for config in (RLConfig, SFTConfig):  # refused before anything loads
        with pytest.raises(ValueError, match="--system-prompt needs chat rendering: drop --chat off"):
            config(model="test", chat="off", system_prompt="S")


def test_system_prompt_goes_first_unless_the_conversation_has_its_own():
    chat = ChatFormat("S")
    assert chat.first("q") == [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]
    assert chat.first(own) == own
    assert chat.later("=5\n") == [{"role": "user", "content": "=5\n"}]
    assert ChatFormat().first("q") == [{"role": "user", "content": "q"}]


def test_plain_data_prompts_are_rendered_as_the_episode_renders_them(tmp_path):
    from helpers import small_config

    from spinwheel.rl.llm.build import load_prompts

    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(4)))
    tok = chatml_tokenizer()
    config = small_config(tmp_path, data=str(data), chat="on", system_prompt="Add.")
    train, held_out = load_prompts(config, tok, chat=resolve_chat(config.chat, tok, config.system_prompt))
    for p in train + held_out:
        messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": p.text}]
        assert list(p.ids) == hf_ids(tok, messages) and p.text == f"{int(p.answer) - 1}+1="
    plain, _ = load_prompts(small_config(tmp_path, data=str(data)), tok)  # no chat: today's raw text with BOS
    assert all(list(p.ids) == tok.encode(p.text) for p in plain)


def test_conversational_jsonl_lines(tmp_path):
    rl = tmp_path / "rl.jsonl"
    prompt = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}]
    rl.write_text(json.dumps({"prompt": prompt, "answer": 4, "level": 1}) + "\n")
    (record,) = read_rl_jsonl(rl)
    assert record.messages == prompt and record.prompt is None and record.answer == "4"
    assert record.columns == {"answer": 4, "level": 1}
    sft = tmp_path / "sft.jsonl"
    reply = [{"role": "assistant", "content": "4"}]
    sft.write_text(json.dumps({"prompt": prompt, "completion": reply}) + "\n")
    (example,) = read_sft_jsonl(sft)
    assert example.messages == prompt + reply and example.prompt is None
    bad = {
        json.dumps({"prompt": prompt, "completion": "4"}): "field 'completion' must be a list of messages",
        json.dumps({"prompt": prompt}): "missing field 'completion'",
        json.dumps({"prompt": prompt, "completion": reply * 2}): "must hold one assistant message, got 2",
        json.dumps({"prompt": prompt + reply, "completion": reply}): r"field 'prompt\[2\].role' must be 'user'",
        json.dumps({"prompt": [], "completion": reply}): "field 'prompt' must be a non-empty list",
        json.dumps({"prompt": prompt, "completion": [{"role": "bot", "content": "4"}]}): r"'completion\[0\].role'",
    }
    for line, message in bad.items():
        sft.write_text('{"prompt": "1+1=", "completion": "2"}\n' + line + "\n")
        with pytest.raises(DataError, match=f"^{sft}:2: .*{message}"):
            read_sft_jsonl(sft)
    rl.write_text(json.dumps({"prompt": [{"role": "user", "content": 3}], "answer": 4}) + "\n")
    with pytest.raises(DataError, match=rf"^{rl}:1: field 'content' must be a string"):
        read_rl_jsonl(rl)


def test_sft_plain_and_conversational_lines_under_chat(tmp_path):
    from spinwheel.train.sft.sft_config import SFTConfig
    from spinwheel.train.sft.sft_data import build_data

    data = tmp_path / "sft.jsonl"
    prompt = [{"role": "user", "content": "3+4="}]
    lines = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(3)]
    lines.append({"prompt": prompt, "completion": [{"role": "assistant", "content": "7"}]})
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tok = chatml_tokenizer()
    built = build_data(SFTConfig(data=str(data), chat="on", system_prompt="Add.", eval_fraction=0.25), tok)
    examples = built.train + built.eval
    assert len(examples) == 4
    for e in examples:
        user = "3+4=" if e.reference == "7" else f"{int(e.reference) - 1}+1="
        expected = hf_ids(tok, [{"role": "system", "content": "Add."}, {"role": "user", "content": user}])
        assert list(e.prompt_ids) == expected
        assert list(e.completion_ids) == tok.encode(e.reference, add_special_tokens=False) + [tok.eos_id]
    raw = build_data(SFTConfig(data=str(data), chat="off", eval_fraction=0.25), tok)
    plain = [e for e in raw.train + raw.eval if e.reference != "7"]
    assert len(plain) == 3 and all(list(e.prompt_ids) == tok.encode(e.prompt) for e in plain)
