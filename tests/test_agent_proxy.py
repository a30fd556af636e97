"""Black-box agents (spinwheel.rl.llm.agents.agent_proxy): an agent written against the ``openai`` client, served the
policy on a local base URL; its calls' tokens recorded as the engine sampled them, chained into one episode whose mask
covers the sampled tokens only; agents that fail, hang or cannot be recorded counted; a short GRPO run on the
recorded episodes raising the agent's reward."""

from __future__ import annotations

import importlib.util
import math
import re
import time
from pathlib import Path

import pytest
import torch
from helpers import grpo_step, run_cli

import spinwheel
from spinwheel.engine import LLM, SamplingParams
from spinwheel.rl.llm.agents.agent_calls import ModelCall, chain_calls
from spinwheel.rl.llm.agents.agent_proxy import AgentConfig, agent_metrics, load_agent, play_agent_episodes
from spinwheel.rl.llm.episode_tokens import episode_batch, episode_metrics, episode_rewards
from spinwheel.rl.llm.episodes import turn_seed
from spinwheel.train.learners import LocalLearner, OptimConfig

TOK = spinwheel.Tokenizer.char_level()
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "calculator_agent.py"


def _llm(seed: int = 5) -> LLM:
    return LLM(spinwheel.load_model("test", vocab_size=100, seed=seed), TOK, num_kv_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def llm():
    return _llm()


def two_calls(client, task: dict) -> float:
    """Ask, append the answer and an observation, ask again (the calls chain); what the agent saw is kept."""
    prompt = task["prompt"]
    first = client.completions.create(model="any", prompt=prompt, max_tokens=5)
    prompt += first.choices[0].text + "=7\n"
    second = client.completions.create(model="any", prompt=prompt, max_tokens=4)
    task["seen"].append((first.model_dump(), second.model_dump(), prompt))
    return float(len(second.choices[0].text))


def test_recorded_tokens_equal_what_the_engine_sampled(llm):
    seen: list = []
    tasks = [{"prompt": "12*3=", "seen": seen}, {"prompt": "ab", "seen": seen}]

    def agent(client, task):
        task["seen"] = seen  # the runner hands the agent a copy of the task
        return two_calls(client, task)

    episodes = play_agent_episodes(llm, agent, tasks, group_size=2, seed=3, step=1)
    assert [(e.env_index, e.sample_index) for e in episodes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert not any(e.failed for e in episodes) and len(seen) == 4
    offline = _llm()  # the same weights, sampled offline with the seeds the proxy gave each call
    for e in episodes:
        assert e.info["agent_segments"] == 1 and e.num_turns == 2
        (p1, c1, lp1), (p2, c2, lp2) = _calls(e)
        for k, (prompt, ids, lps) in enumerate([(p1, c1, lp1), (p2, c2, lp2)]):
            seed = turn_seed(3, 1, e.env_index, e.sample_index, k) % 2**63
            params = SamplingParams(max_tokens=5 - k, seed=seed, logprobs=0, logprobs_mode="processed")
            want = offline.generate([prompt], params)[0].outputs[0]
            assert ids == want.token_ids
            assert lps == pytest.approx([lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-6)
        assert e.token_ids == p2 + c2 and p2[: len(p1) + len(c1)] == p1 + c1  # one chained sequence
        assert e.mask == [0] * len(p1) + [1] * len(c1) + [0] * (len(p2) - len(p1) - len(c1)) + [1] * len(c2)
        assert e.turn_ends == [len(p1) + len(c1) - 1, len(e.token_ids) - 1] and e.reward == e.turn_rewards[-1]
    first, second, prompt = seen[0]
    assert "token_ids" not in first["choices"][0] and first["choices"][0]["logprobs"] is None  # the agent's view
    assert TOK.encode(prompt) in [e.token_ids[: len(TOK.encode(prompt))] for e in episodes]
    batch = episode_batch(episodes, TOK.pad_id)  # the trainer's log-probs equal the engine's on sampled tokens
    logprobs = LocalLearner(llm.model, None).forward({"input_ids": batch["input_ids"], "labels": batch["labels"]})
    on = batch["mask"].bool()
    assert on.sum() == sum(sum(e.mask) for e in episodes)
    torch.testing.assert_close(logprobs["logprobs"][on], batch["engine_logprobs"][on], atol=1e-5, rtol=0)


def _calls(e) -> list[tuple[list[int], list[int], list[float]]]:
    """The episode's calls back from its mask: (prompt, sampled ids, their log-probs) per call."""
    out = []
    for end in e.turn_ends:
        first = end
        while first > 0 and e.mask[first - 1] == 1:
            first -= 1
        out.append((e.token_ids[:first], e.token_ids[first : end + 1], e.engine_logprobs[first : end + 1]))
    return out


def test_calls_that_do_not_chain_are_segments_counted_and_the_last_is_trained():
    a = ModelCall([1, 5, 6], [7, 8], [-0.5, -0.25], "xy")
    b = ModelCall([1, 5, 6, 7, 8, 9], [10], [-1.0], "z")  # extends a
    c = ModelCall([1, 5, 7], [11, 12], [-0.1, -0.2], "edited")  # the agent rewrote the history
    chains = chain_calls([a, b, c])
    assert len(chains) == 2
    assert chains[0].token_ids == [1, 5, 6, 7, 8, 9, 10] and chains[0].mask == [0, 0, 0, 1, 1, 0, 1]
    assert chains[0].logprobs == [0, 0, 0, -0.5, -0.25, 0, -1.0] and chains[0].turn_ends == [4, 6]
    assert chains[1].token_ids == [1, 5, 7, 11, 12] and chains[1].prompt_len == 3


def edits_history(client, task):
    client.completions.create(model="m", prompt="abc", max_tokens=3)
    client.completions.create(model="m", prompt="xyz", max_tokens=3)
    return 1.0


def failing(client, task):
    mode = task["mode"]
    if mode == "ok":
        client.completions.create(model="m", prompt="hi", max_tokens=2)
        return 0.5
    if mode == "raises":
        client.completions.create(model="m", prompt="hi", max_tokens=2)
        raise RuntimeError("tool crashed")
    if mode == "nan":
        client.completions.create(model="m", prompt="hi", max_tokens=2)
        return math.nan
    if mode == "stream":
        try:
            for _ in client.completions.create(model="m", prompt="hi", max_tokens=2, stream=True):
                pass
        except Exception:  # the agent swallows the error: the episode still fails
            pass
        return 1.0
    if mode == "n2":
        client.completions.create(model="m", prompt="hi", max_tokens=2, n=2)
    if mode == "hangs":
        time.sleep(30)
    return 1.0  # "silent": no model call


def test_failing_agents_are_counted_and_the_engine_is_left_idle(llm):
    modes = ["ok", "raises", "nan", "stream", "n2", "silent", "hangs"]
    t0 = time.monotonic()
    episodes = play_agent_episodes(
        llm, failing, [{"mode": m} for m in modes], 1, config=AgentConfig(timeout_s=1.5, num_workers=8)
    )
    assert time.monotonic() - t0 < 10
    errors = {m: e.error for m, e in zip(modes, episodes)}
    assert [e.failed for e in episodes] == [False] + [True] * 6
    assert "RuntimeError: tool crashed" in errors["raises"] and "not a finite number" in errors["nan"]
    assert "stream" in errors["stream"] and "n or best_of" in errors["n2"]
    assert "no model call" in errors["silent"] and "within 1.5 s" in errors["hangs"]
    assert episode_metrics(episodes)["episodes_failed"] == 6 and episodes[0].reward == 0.5
    rewards, keep = episode_rewards(episodes, 1)
    assert keep.tolist() == [1, 0, 0, 0, 0, 0, 0]
    assert not llm.engine.has_unfinished_requests()
    split = play_agent_episodes(llm, edits_history, [{}], 1)
    assert split[0].info["agent_segments"] == 2 and agent_metrics(split)["agent_runs_split"] == 1
    assert split[0].token_ids[: len(TOK.encode("xyz"))] == TOK.encode("xyz")  # the last segment is trained


def test_chat_calls_chain_when_the_template_renders_the_sampled_tokens(llm):
    ab = {str(TOK.encode(ch, add_special_tokens=False)[0]): 100 for ch in "ab"}  # only a and b: text round-trips

    def chat(client, task):
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=4, logit_bias=ab)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "=7"},
            ]
        return 1.0

    (e,) = play_agent_episodes(llm, chat, [{}], 1)
    assert not e.failed and e.info["agent_segments"] == 1 and sum(e.mask) == 8
    opened = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False)
    assert e.token_ids[: len(opened)] == opened and e.prompt_len == len(opened)
    assert set(TOK.decode([t for t, m in zip(e.token_ids, e.mask) if m])) <= {"a", "b"}


def test_load_agent_one_line_errors():
    assert load_agent(f"{EXAMPLE}:agent").__name__ == "agent"
    assert load_agent("spinwheel.rl.llm.agents.agent_proxy:load_agent") is load_agent
    for spec, needle in [("nocolon", "module:function"), ("no_such_mod:f", "cannot import"), (f"{EXAMPLE}:nope", "no")]:
        with pytest.raises(ValueError, match=needle):
            load_agent(spec)


def test_calculator_agent_and_grpo_on_recorded_episodes_raises_the_reward():
    """The example agent drives the calculator format; a tiny GRPO run on a two-call agent's episodes (the reward:
    the share of digits the model writes) raises its reward."""
    spec = importlib.util.spec_from_file_location("calculator_agent", EXAMPLE)
    calc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calc)
    assert calc.calculate("317*46") == 14582 and calc.calculate("__import__('os')") is None
    llm = _llm(seed=11)
    for agent in (calc.agent, calc.chat_agent):
        eps = play_agent_episodes(llm, agent, calc.tasks(2), 2, config=AgentConfig(timeout_s=30))
        assert len(eps) == 4 and not any(e.failed for e in eps) and all(e.num_turns >= 1 for e in eps)

    def digits(client, task):
        text = client.completions.create(model="m", prompt=task["p"], max_tokens=6).choices[0].text
        more = client.completions.create(model="m", prompt=task["p"] + text + ";", max_tokens=6).choices[0].text
        return sum(ch.isdigit() for ch in text + more) / 12

    learner = LocalLearner(llm.model, OptimConfig(lr=0.1))
    tasks, group, means = [{"p": "a"}, {"p": "b"}, {"p": "c"}, {"p": "d"}], 4, []
    for step in range(5):
        eps = play_agent_episodes(llm, digits, tasks, group, seed=1, step=step)
        figures = grpo_step(learner, eps, group, lr=0.1, updates=2, pad=TOK.pad_id)
        llm.update_weights(llm.model)
        means.append(figures["episode_reward_mean"])
        assert figures["mismatch_max"] < 1e-4 and figures["agent_calls_mean"] == 2
    assert means[-1] > means[0] + 0.2, means


def test_grpo_command_bad_agent_is_one_line(capfd):
    """``spinwheel grpo --agent`` (the one GRPO loop: the short ``agent_train`` command is gone) refuses a spec it
    cannot import in one line."""
    proc = run_cli(["grpo", "--model", "test", "--agent", "nope:f", "--agent-tasks", f"{EXAMPLE}:task"], capfd)
    assert proc.returncode != 0
    assert re.search(r"error: --agent 'nope:f': cannot import nope", proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr


DIGITS_AGENT = """
RUNS = []  # (split, reward) of every run, in the order they finished


def agent(client, task):
    text = client.completions.create(model="m", prompt=task["p"], max_tokens=4,
                                     temperature=task["temperature"]).choices[0].text
    more = client.completions.create(model="m", prompt=task["p"] + text + ";", max_tokens=4,
                                     temperature=task["temperature"]).choices[0].text
    reward = sum(ch.isdigit() for ch in text + more) / 8
    RUNS.append((task["split"], reward))
    return reward


def task(seed, split):
    return {"p": "abcdefgh"[seed % 8], "split": split}
"""


def test_grpo_agent_option_trains_on_the_agent_runs(tmp_path, monkeypatch):
    """``spinwheel grpo --agent``: the RL loop's episodes are the agent's runs (tokens as the engine sampled them,
    the step's reward the agent's), held-out evaluation greedy on test-split tasks; bad specs are one line."""
    import sys

    from helpers import small_config

    from spinwheel.rl.llm import train_rl
    from spinwheel.rl.llm.agents.agent_run import AgentTasks
    from spinwheel.train.metrics import read_metrics

    (tmp_path / "digits_agent.py").write_text(DIGITS_AGENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = dict(data=None, reward="task", agent="digits_agent:agent", steps=1, prompts_per_step=2, group_size=2)
    train_rl(small_config(tmp_path / "run", **base, eval_examples=2, beta=0.0))
    runs = sys.modules["digits_agent"].RUNS
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 1 and all(r["episodes"] == 4 and r["episodes_failed"] == 0 for r in steps)
    assert all(r["mismatch_max"] < 1e-4 for r in steps)  # trained on the tokens the engine sampled
    train = [reward for split, reward in runs if split == "train"]
    assert len(train) == 4 and sum(r["reward_mean"] for r in steps) * 4 == pytest.approx(sum(train), abs=1e-6)
    evals = [r for r in recs if "eval_reward" in r]
    assert evals[-1]["eval_agent_calls"] == 2 and sum(split == "test" for split, _ in runs) == 2 * len(evals)
    for kw, needle in [
        (dict(agent="nope:f"), "--agent 'nope:f': cannot import nope"),
        (dict(agent="digits_agent:agent", agent_tasks="digits_agent:nope"), "--agent-tasks 'digits_agent:nope'"),
        (dict(agent="spinwheel.rl.llm.agents.agent_proxy:load_agent"), "its module has no function task"),
    ]:
        with pytest.raises(ValueError, match=needle):
            AgentTasks(small_config(tmp_path / "bad", **{**base, **kw}))
    for kw, needle in [(dict(env="guess"), "--agent takes its tasks"), (dict(algo="ppo"), "--agent trains with")]:
        with pytest.raises(ValueError, match=needle):
            small_config(tmp_path / "bad", **{**base, **kw})
