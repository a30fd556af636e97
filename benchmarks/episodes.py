"""Multi-turn episodes on spinwheel's engine: prefill saved by token-in/token-out with the prefix cache, and episodes/s
with many episodes in flight.

    .venv/bin/python benchmarks/episodes.py                       # tiny preset, 4-turn episodes, 32 tokens a turn
    .venv/bin/python benchmarks/episodes.py --env-latency-ms 20   # each env.step also waits 20 ms (a tool call)

Both parts play the same 4-turn environment (a tool-like observation of ~16 characters after each turn; the episode
ends after the 4th turn) with the model's random weights, at temperature 1.

**Prefill per episode** (``--prefill-episodes`` episodes, one per environment seed): prompt tokens the engine
computed, divided by the number of episodes, for

- ``driver``: :func:`spinwheel.rl.llm.episodes.run_episodes` — each turn re-submits the episode's token list and
  the prefix cache (on, as by default) serves the history's full KV blocks;
- ``driver, no cache``: the same with ``enable_prefix_caching=False`` (what the cache alone saves);
- ``re-tokenised``: what text-based agent loops do — each turn the history's *text* is tokenized again and submitted
  as a new prompt to an engine without prefix caching (all episodes' turn k in one ``generate`` call).

**Episodes/s**: ``--flight`` episodes in one ``run_episodes`` call (all in flight; environment calls on the worker
pool) against ``--serial`` episodes played one ``run_episodes`` call each (one episode at a time), same settings.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spinwheel.engine import LLM, SamplingParams  # noqa: E402
from spinwheel.envs.base import Action, Env, Step  # noqa: E402
from spinwheel.models.hf import load_model  # noqa: E402
from spinwheel.models.tokenizer import Tokenizer  # noqa: E402
from spinwheel.rl.llm.episode_tokens import episode_metrics  # noqa: E402
from spinwheel.rl.llm.episodes import EpisodeConfig, EpisodeGroup, prefill_counts, run_episodes, turn_seed  # noqa: E402
from spinwheel.rl.llm.rollout import sample_seed  # noqa: E402

TURNS = 4


class ToolEnv(Env):
    """Four turns; after each, a tool-like result of ~16 characters."""

    max_turns = TURNS
    latency_s = 0.0

    def reset(self, seed: int) -> str:
        self.turn, self.seed = 0, seed
        return f"task {seed:04d}: compute\n"

    def step(self, action: Action) -> Step:
        time.sleep(self.latency_s)
        self.turn += 1
        if self.turn == TURNS:
            return Step(None, 1.0, True)
        return Step(f"\n<r>{(self.seed * 7919 + self.turn) % 100000:05d}</r>\n", 0.0, False)


def make_llm(model, tokenizer: Tokenizer, cache: bool) -> LLM:
    return LLM(model, tokenizer, seed=0, enable_prefix_caching=cache)


def driver_prefill(model, tokenizer, config: EpisodeConfig, num: int, cache: bool) -> tuple[float, float]:
    """(computed prompt tokens per episode, cached prompt tokens per episode) with the driver."""
    llm = make_llm(model, tokenizer, cache)
    groups = [EpisodeGroup([ToolEnv()], seed, seed) for seed in range(num)]
    before = prefill_counts(llm.engine)
    episodes = run_episodes(llm.engine, groups, config, seed=0, step=0)
    assert episode_metrics(episodes)["episodes_failed"] == 0
    computed, cached = (a - b for a, b in zip(prefill_counts(llm.engine), before))
    llm.close()
    return computed / num, cached / num


def retokenised_prefill(model, tokenizer: Tokenizer, config: EpisodeConfig, num: int) -> float:
    """Computed prompt tokens per episode when every turn re-tokenizes the history's text (no prefix cache)."""
    llm = make_llm(model, tokenizer, cache=False)
    envs = [ToolEnv() for _ in range(num)]
    texts = [env.reset(seed) for seed, env in enumerate(envs)]
    live = list(range(num))
    before = llm.engine.num_prompt_tokens
    for turn in range(TURNS):
        params = [
            SamplingParams(
                temperature=config.temperature,
                max_tokens=config.max_new_tokens,
                seed=sample_seed(0, 0, i) if turn == 0 else turn_seed(0, 0, i, 0, turn),
            )
            for i in live
        ]
        outs = llm.generate([tokenizer.encode(texts[i]) for i in live], params)
        for i, out in zip(list(live), outs):
            c = out.outputs[0]
            answer = envs[i].step(Action(c.text, list(c.token_ids)))
            texts[i] += c.text + (answer.observation or "")
            if answer.done:
                live.remove(i)
    computed = llm.engine.num_prompt_tokens - before
    llm.close()
    return computed / num


def episodes_per_s(model, tokenizer, config: EpisodeConfig, num: int, together: bool) -> float:
    llm = make_llm(model, tokenizer, cache=True)
    groups = [EpisodeGroup([ToolEnv()], 1000 + seed, seed) for seed in range(num)]
    run_episodes(llm.engine, groups[:2], config, seed=1, step=0)  # warm-up
    start = time.perf_counter()
    if together:
        episodes = run_episodes(llm.engine, groups, config, seed=0, step=0)
    else:
        episodes = [e for g in groups for e in run_episodes(llm.engine, [g], config, seed=0, step=0)]
    wall = time.perf_counter() - start
    assert all(e.done for e in episodes)
    llm.close()
    return num / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a preset (random weights) or a checkpoint")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per turn at most")
    parser.add_argument("--prefill-episodes", type=int, default=16)
    parser.add_argument("--flight", type=int, default=64, help="episodes in flight at once")
    parser.add_argument("--serial", type=int, default=16, help="episodes played one at a time")
    parser.add_argument("--env-latency-ms", type=float, default=0.0, help="sleep in every env.step")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ToolEnv.latency_s = args.env_latency_ms / 1000
    tokenizer = Tokenizer.char_level()
    model = load_model(args.model, vocab_size=tokenizer.vocab_size, seed=5).eval()
    config = EpisodeConfig(max_new_tokens=args.max_new_tokens, env_timeout_s=None)
    n = args.prefill_episodes
    print(
        f"model {args.model}, {TURNS}-turn episodes, ≤ {args.max_new_tokens} tokens a turn, torch threads "
        f"{torch.get_num_threads()}, env latency {args.env_latency_ms:g} ms"
    )
    ours, cached = driver_prefill(model, tokenizer, config, n, cache=True)
    uncached, _ = driver_prefill(model, tokenizer, config, n, cache=False)
    retok = retokenised_prefill(model, tokenizer, config, n)
    print(f"prefill tokens per episode ({n} episodes):")
    print(f"  driver (prefix cache)        {ours:8.1f} computed, {cached:.1f} served from the cache")
    print(f"  driver, no prefix cache      {uncached:8.1f}")
    print(f"  re-tokenised history         {retok:8.1f}")
    print(f"  ratio re-tokenised / driver  {retok / ours:8.2f}x")
    flight = episodes_per_s(model, tokenizer, config, args.flight, together=True)
    serial = episodes_per_s(model, tokenizer, config, args.serial, together=False)
    print("episodes/s:")
    print(f"  {args.flight} in flight               {flight:8.2f}")
    print(f"  one at a time                {serial:8.2f}")
    print(f"  ratio                        {flight / serial:8.2f}x")


if __name__ == "__main__":
    main()
