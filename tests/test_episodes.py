"""Multi-turn episodes on the engine (spinwheel.rl.llm.episodes): token-in/token-out with a BPE tokenizer whose merges
cross turn boundaries, the single-turn path equal to generate_rollout, environment faults failing their episode only,
and environment calls off the engine's critical path."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from helpers import all_blocks_free, generate_rollout

from spinwheel.engine import LLM
from spinwheel.envs.base import Action, Env, Step
from spinwheel.models import Transformer
from spinwheel.models.presets import preset_config
from spinwheel.models.tokenizer import BOS, EOS, PAD, UNK, Tokenizer
from spinwheel.rl.llm.env_calls import EnvWorkers
from spinwheel.rl.llm.episode_tokens import chat_suffix, episode_batch, episode_metrics
from spinwheel.rl.llm.episodes import (
    EpisodeConfig,
    EpisodeGroup,
    EpisodesInterrupted,
    prefill_counts,
    run_episodes,
)
from spinwheel.rl.llm.rollout import Prompt, rollout_batch
from spinwheel.train.learners import LocalLearner

T = 0.7
ALPHABET = "abcdefgh0123=>"


def bpe_tokenizer() -> Tokenizer:
    """A byte-pair tokenizer trained here, with no pre-tokenizer: merges span anything, among them a turn's last
    characters glued to the "=>" every observation starts with."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, processors, trainers

    backend = HFTokenizer(models.BPE(unk_token=UNK))
    backend.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=72, special_tokens=[PAD, BOS, EOS, UNK], initial_alphabet=list(ALPHABET), show_progress=False
    )
    rng = random.Random(0)
    corpus = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 4))) + "=>" + str(i % 4) for i in range(400)]
    backend.train_from_iterator(corpus, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, backend.token_to_id(BOS))]
    )
    return Tokenizer(backend, BOS, EOS, PAD)


def make_llm(tokenizer: Tokenizer, max_model_len: int = 128, **config) -> LLM:
    model = Transformer(preset_config("test", vocab_size=tokenizer.vocab_size)).init_weights(seed=3, std=0.1).eval()
    return LLM(model, tokenizer, seed=0, max_model_len=max_model_len, **config)


class CountEnv(Env):
    """Three turns; every observation starts with "=>"; it keeps what it was sent and what it answered."""

    max_turns = 3

    def __init__(self, split: str = "train", sleep_s: float = 0.0, first_sleep_s: float = 0.0) -> None:
        super().__init__(split)
        self.sleep_s, self.first_sleep_s = sleep_s, first_sleep_s
        self.actions: list[Action] = []
        self.observations: list[str] = []
        self.step_times: list[float] = []

    def reset(self, seed: int) -> str:
        self.observations = [f"{'abcdefgh'[seed % 8]}{seed % 4}=>"]
        return self.observations[0]

    def step(self, action: Action) -> Step:
        time.sleep(self.first_sleep_s if not self.actions and self.first_sleep_s else self.sleep_s)
        self.actions.append(action)
        self.step_times.append(time.monotonic())
        if len(self.actions) == 3:
            return Step(None, 1.0, True, {"turns": 3.0})
        self.observations.append(f"=>{len(self.actions)}")
        return Step(self.observations[-1], 0.5, False, {"turns": float(len(self.actions))})


def test_episode_tokens_are_the_sampled_and_fed_tokens_and_logprobs_match_the_trainer():
    """Token-in/token-out: each episode is exactly the reset's tokens, the engine's sampled tokens and the
    observations' tokens; re-tokenising the text would have drifted; the trainer's log-probs at T equal the
    engine's on sampled tokens; the history's KV blocks come from the prefix cache."""
    tok = bpe_tokenizer()
    llm = make_llm(tok, block_size=4)
    engine, prompts, sampled = llm.engine, [], []  # every request's prompt and every turn the engine handed back
    add, step = engine.add_request, engine.step

    def recording_add(request_id, prompt, params):
        prompts.append(list(prompt))
        add(request_id, prompt, params)

    def recording_step(stream=True):
        outs = step(stream)
        sampled.extend(tuple(c.token_ids) for out in outs if out.finished for c in out.outputs)
        return outs

    engine.add_request, engine.step = recording_add, recording_step
    groups = [EpisodeGroup([CountEnv() for _ in range(3)], seed, i) for i, seed in enumerate([5, 6, 7, 12])]
    before = prefill_counts(engine)
    episodes = run_episodes(engine, groups, EpisodeConfig(max_new_tokens=6, temperature=T), seed=1, step=0)
    computed, cached = (a - b for a, b in zip(prefill_counts(engine), before))
    envs = [env for g in groups for env in g.envs]
    boundary_merges = 0
    for e, env in zip(episodes, envs):
        assert not e.failed and e.done and e.num_turns == 3 and e.reward == 2.0 and e.info == {"turns": 3.0}
        expected, mask = tok.encode(env.observations[0]), [0] * len(tok.encode(env.observations[0]))
        for k, action in enumerate(env.actions):
            assert tuple(action.token_ids) in sampled  # what the engine sampled, as the environment received it
            expected += action.token_ids
            mask += [1] * len(action.token_ids)
            assert e.turn_ends[k] == len(expected) - 1
            if k + 1 < len(env.observations):
                obs = tok.encode(env.observations[k + 1], add_special_tokens=False)
                expected, mask = expected + obs, mask + [0] * len(obs)
                glued = tok.decode(action.token_ids[-1:]) + env.observations[k + 1]
                boundary_merges += tok.encode(glued, add_special_tokens=False) != action.token_ids[-1:] + obs
        assert e.token_ids == expected and e.mask == mask
    assert len(prompts) == len(groups) + sum(e.num_turns - 1 for e in episodes)  # a group's first turn: one request
    assert all(any(e.token_ids[: len(p)] == p for e in episodes) for p in prompts)  # the whole history each turn
    assert boundary_merges > 0  # merges cross the turn boundary
    assert episode_metrics(episodes)["episodes_drift"] >= 1  # the re-tokenised text differs: drift was avoided
    batch = episode_batch(episodes, tok.pad_id)
    logprobs = LocalLearner(llm.model, None, temperature=T).forward(
        {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    )["logprobs"]
    on = batch["mask"].bool()
    assert on.sum() == sum(sum(e.mask) for e in episodes)
    torch.testing.assert_close(logprobs[on], batch["engine_logprobs"][on], atol=1e-5, rtol=0)
    assert batch["turn_rewards"].sum() == sum(e.reward for e in episodes)
    assert cached > 0 and computed + cached <= sum(len(p) for p in prompts)


class AddEnv(Env):
    """A one-step environment: the prompt is a sum, the reward 1 for any answer."""

    def reset(self, seed: int) -> str:
        return f"{seed % 7}+{seed % 5}="

    def step(self, action: Action) -> Step:
        return Step(None, 1.0, True)


def test_one_step_episodes_sample_what_generate_rollout_samples():
    tok = Tokenizer.char_level()
    llm = make_llm(tok, max_model_len=64)
    seeds = [3, 11, 20]
    prompts = [Prompt(AddEnv().reset(s), tuple(tok.encode(AddEnv().reset(s))), "") for s in seeds]
    rollout = generate_rollout(llm, prompts, 2, 9, 4, 6, T, 0.9)
    groups = [EpisodeGroup([AddEnv() for _ in range(4)], s, i) for i, s in enumerate(seeds)]
    config = EpisodeConfig(max_new_tokens=6, temperature=T, top_p=0.9)
    episodes = run_episodes(llm.engine, groups, config, seed=9, step=2)
    assert [e.token_ids[e.prompt_len :] for e in episodes] == rollout.completion_ids
    assert [e.engine_logprobs[e.prompt_len :] for e in episodes] == rollout.engine_logprobs
    ours, theirs = episode_batch(episodes, tok.pad_id), rollout_batch(rollout, tok.pad_id)
    for key in ("input_ids", "labels", "mask", "engine_logprobs", "prompt_lens", "completion_lens"):
        assert torch.equal(ours[key], theirs[key]), key


class FaultyEnv(CountEnv):
    """CountEnv with one fault, picked by ``fault``."""

    release = threading.Event()  # lets the hanging calls return once the test is over

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def reset(self, seed: int):
        if self.fault == "reset":
            raise RuntimeError("no episode today")
        return super().reset(seed)

    def step(self, action: Action):
        answer = super().step(action)
        if self.fault == "step":
            raise KeyError("boom")
        if self.fault == "hang":
            FaultyEnv.release.wait(10)
        if self.fault == "nan":
            answer.reward = float("nan")
        if self.fault == "huge":
            answer.observation = "a" * 100_000
        if self.fault == "tuple":
            return answer.observation, answer.reward, answer.done, answer.info
        if self.fault == "overflow":
            answer.observation = "=>" + "ab" * 40
        return answer


def test_environment_faults_fail_their_episode_only():
    llm = make_llm(Tokenizer.char_level(), max_model_len=64)
    faults = ["ok", "reset", "step", "hang", "nan", "huge", "tuple", "overflow", "ok"]
    groups = [EpisodeGroup([FaultyEnv(f) for _ in range(2)], 4, i) for i, f in enumerate(faults)]
    config = EpisodeConfig(max_new_tokens=4, env_timeout_s=0.5, max_observation_chars=1000)
    try:
        episodes = run_episodes(llm.engine, groups, config, seed=0, step=0)
    finally:
        FaultyEnv.release.set()
    by_fault = {f: episodes[2 * i : 2 * i + 2] for i, f in enumerate(faults)}
    errors = {
        "reset": "raised RuntimeError: no episode today",
        "step": "raised KeyError",
        "hang": "did not return within 0.5 s",
        "nan": "reward must be a finite number",
        "huge": "observation of 100000 characters is over the cap of 1000",
        "tuple": "step must return a Step",
    }
    for fault, error in errors.items():
        assert all(e.failed and error in e.error for e in by_fault[fault]), (fault, by_fault[fault][0].error)
    for e in by_fault["ok"]:
        assert not e.failed and e.done and e.reward == 2.0
    for e in by_fault["overflow"]:  # the observation would overflow the 64-token context: truncated, not failed
        assert not e.failed and e.truncated and e.end_reason == "max_tokens" and e.reward == 0.5 and e.num_turns == 1
    assert episode_metrics(episodes)["episodes_failed"] == 12
    assert not llm.engine.has_unfinished_requests() and all_blocks_free(llm.engine)


def test_turn_limit_truncates_with_the_rewards_so_far_and_stop_interrupts():
    llm = make_llm(Tokenizer.char_level(), max_model_len=64)
    groups = [EpisodeGroup([CountEnv() for _ in range(2)], 1, 0)]
    episodes = run_episodes(llm.engine, groups, EpisodeConfig(max_new_tokens=4, max_turns=2), seed=0, step=0)
    assert all(e.truncated and e.end_reason == "max_turns" and e.reward == 1.0 for e in episodes)
    calls = iter(range(1000))
    with pytest.raises(EpisodesInterrupted):
        run_episodes(llm.engine, groups, EpisodeConfig(max_new_tokens=4), 0, 0, should_stop=lambda: next(calls) > 3)
    assert not llm.engine.has_unfinished_requests() and all_blocks_free(llm.engine)


class ChatEnv(Env):
    max_turns = 2

    def reset(self, seed: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"hi {seed}"}]

    def step(self, action: Action) -> Step:
        self.turn = getattr(self, "turn", 0) + 1
        return Step([{"role": "user", "content": "more"}], 1.0, self.turn == 2)


def test_chat_observations_append_only_the_new_suffix():
    tok = Tokenizer.char_level()
    llm = make_llm(tok, max_model_len=64)
    (e,) = run_episodes(llm.engine, [EpisodeGroup([ChatEnv()], 4, 0)], EpisodeConfig(max_new_tokens=4), 0, 0)
    first = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi 4"}]), add_special_tokens=False)
    assert e.done and e.token_ids[: e.prompt_len] == first
    fed = [t for t, m in zip(e.token_ids[e.prompt_len :], e.mask[e.prompt_len :]) if m == 0]
    assert tok.decode(fed) == "\n<|user|>\nmore\n<|assistant|>\n"
    history, new = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "more"}]
    assert chat_suffix(tok, history, "yo", False, new) == "\n<|user|>\nmore\n<|assistant|>\n"
    tok.chat_template = (  # a template that writes EOS at the end of each turn, as ChatML does
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert chat_suffix(tok, history, "yo", True, new) == "\n<|user|>more<eos>\n<|assistant|>"  # EOS was sampled
    assert chat_suffix(tok, history, "yo", False, new) == "<eos>\n<|user|>more<eos>\n<|assistant|>"


def test_environment_calls_run_off_the_engines_critical_path():
    """Every step sleeps 0.2 s and one environment's first step 1.2 s: the others play their three turns while it
    sleeps, and the whole rollout takes far less than its environments' sleeps one after another (7.2 s; in flight
    about 1.6 s)."""
    llm = make_llm(Tokenizer.char_level(), max_model_len=64)
    groups = [EpisodeGroup([CountEnv(sleep_s=0.2, first_sleep_s=1.2 if i == 0 else 0.0)], i, i) for i in range(8)]
    start = time.monotonic()
    episodes = run_episodes(llm.engine, groups, EpisodeConfig(max_new_tokens=4), seed=0, step=0)
    wall = time.monotonic() - start
    assert all(e.done for e in episodes)
    sleeper, others = groups[0].envs[0], [g.envs[0] for g in groups[1:]]
    assert all(env.step_times[-1] < sleeper.step_times[0] for env in others)
    assert wall < 0.6 * 7.2, wall


def test_a_worker_stuck_in_an_abandoned_call_is_replaced():
    workers, release = EnvWorkers(1), threading.Event()
    stuck = workers.submit(release.wait, 10)
    while stuck.started is None:
        time.sleep(0.001)
    assert stuck.overdue(0.0, time.monotonic() + 1) and not stuck.overdue(None, time.monotonic() + 1)
    workers.abandon(stuck)
    assert workers.submit(lambda: 7).future.result(timeout=5) == 7  # served by the replacement
    release.set()
    assert stuck.future.result(timeout=5) is True
    workers.close()
