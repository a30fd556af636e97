"""Multi-turn episodes on spinwheel's engine, token-in/token-out: many episodes in flight, environments off the
engine's critical path.

An episode is one token sequence: the first observation's tokens, then per turn the tokens the engine sampled (mask
1, with their log-probs) and the observation's tokens (mask 0) — exactly what was fed to and sampled by the engine,
never a re-tokenisation (:mod:`~spinwheel.rl.llm.episode_tokens`). The driver (:func:`run_episodes`) steps the
:class:`~spinwheel.engine.LLMEngine` itself: when a turn ends (EOS, one of the environment's ``stop`` strings, kept in
the turn, or the turn's token budget) its ``env.step`` runs on a worker thread (:mod:`~spinwheel.rl.llm.env_calls`)
while the engine goes on with the other episodes; when the observation comes back the next turn is a new request
whose prompt is the whole token list so far, and the engine's prefix cache serves the history's full KV blocks, so
only the observation and the last partial block are prefilled (the verl AgentLoop / SkyRL pattern of re-submitting a
token list, without their re-tokenisation).

Seeds: every episode is a function of (run seed, step, env index, sample index) and the weights. A group's first turn
is one request with ``n = G`` and seed ``sample_seed(seed, step, env index)``, exactly as the single-turn sampler
before episodes did (so a one-step environment samples today's tokens); turn ``t ≥ 1`` of sample ``j`` is a
request of its own with seed :func:`turn_seed`. The engine draws seeded samples from (seed, sample index, position)
alone, so which episodes share a batch changes nothing.

Endings: ``done`` from the environment; **truncated** when the turn limit is reached, or the next observation (or
the next turn) would not fit in ``max_total_tokens`` / the model's context — the observation is then not appended,
and the episode's reward is the sum of the turn rewards received so far (the same rule as a finished episode: the
reward is always the sum of its turn rewards). **failed** when ``reset``/``step`` raises, times out, returns a
reward that is not a finite number, or an observation that is not text/messages or is over the size cap, or when
the engine fails the request: the error is kept, the episode is counted, and nothing is raised out of the driver.
``should_stop()`` turning true (a Ctrl-C flag) aborts the wait with :class:`EpisodesInterrupted`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any

from spinwheel.engine import LLMEngine, SamplingParams
from spinwheel.engine.outputs import CompletionOutput, RequestOutput
from spinwheel.envs.base import Action, Env
from spinwheel.envs.single import step_batch
from spinwheel.rl.llm.env_calls import EnvCall, EnvCallError, EnvWorkers, reset_call, step_answer
from spinwheel.rl.llm.episode_tokens import Episode, EpisodeConfig, has_drift
from spinwheel.rl.llm.rewards import finite_float32
from spinwheel.rl.llm.rollout import sample_seed

WAIT_SLICE_S = 0.01  # how long an idle engine waits on environment calls before looking at the clock again
_request_ids = itertools.count()  # engine request ids, unique in the process


class EpisodesInterrupted(KeyboardInterrupt):
    """The rollout was stopped because ``should_stop()`` turned true (a Ctrl-C or SIGTERM flag)."""


@dataclass
class EpisodeGroup:
    """The G episodes of one environment seed: one environment instance per episode (built by the caller),
    ``index`` the environment's index in the step (what seeds are derived from)."""

    envs: Sequence[Env]
    seed: int
    index: int


def turn_seed(seed: int, step: int, env_index: int, sample_index: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` ≥ 1 of sample ``sample_index`` of environment ``env_index`` at ``step``."""
    return (sample_seed(seed, step, env_index) * 1_000_037 + sample_index) * 1_000_039 + turn


def prefill_counts(engine: LLMEngine) -> tuple[int, int]:
    """(prompt tokens the engine computed, prompt tokens served from the prefix cache) since it was built."""
    return engine.num_prompt_tokens, engine.block_manager.num_prefix_hit_tokens


@dataclass
class _Run:
    """An episode in flight: its record, environment and what it waits on."""

    episode: Episode
    group: int  # position of its group in the driver's list
    env: Env
    max_turns: int
    stop: list[str]
    history: list | None = None  # chat messages so far (chat observations only)
    call: EnvCall | None = None
    calling: str = ""  # "reset" or "step"
    live: bool = True
    batched: bool = False  # its class steps many episodes in one call (one-step environments: one reward call)


def run_episodes(
    engine: LLMEngine,
    groups: list[EpisodeGroup],
    config: EpisodeConfig,
    seed: int,
    step: int,
    should_stop: Callable[[], bool] | None = None,
    figures: dict[str, float] | None = None,
    token_versions: Callable[[str, int, int], list[int]] | None = None,
) -> list[Episode]:
    """Play every group's episodes to the end on ``engine`` (the ``LLM``'s ``.engine``, with a tokenizer);
    episodes come back group-major (``i = group · G + sample``), failed ones included (``failed``, ``error``).
    ``figures`` (when given) receives ``batch_step_s``: the seconds spent in batched steps (reward calls).
    ``token_versions(request_id, sample_index, num_tokens)`` (asynchronous rollouts) gives the policy version of each
    token a turn sampled; they go to ``Episode.versions``."""
    if engine.tokenizer is None:
        raise ValueError("run_episodes needs an engine with a tokenizer (observations are text)")
    driver = _Driver(engine, groups, config, seed, step, should_stop)
    driver.token_versions = token_versions
    episodes = driver.run()
    if figures is not None:
        figures["batch_step_s"] = driver.batch_step_s
    return episodes


class _Driver:
    def __init__(self, engine, groups, config, seed, step, should_stop) -> None:
        self.engine, self.config, self.seed, self.step, self.should_stop = engine, config, seed, step, should_stop
        self.tokenizer = engine.tokenizer
        self.limit = min(config.max_total_tokens or engine.max_model_len, engine.max_model_len)
        self.groups = [[self._new_run(g, k, j, env) for j, env in enumerate(g.envs)] for k, g in enumerate(groups)]
        self.requests: dict[str, list[_Run]] = {}  # engine request id -> its episodes by sample index
        self.waiting: list[_Run] = []  # runs with an environment call out
        self.pending: list[tuple[_Run, Action, bool]] = []  # turns of batched environments, stepped together
        self.batch_step_s = 0.0  # time in batched steps (the one-step reward calls)
        self.started = 0  # groups whose first turn is requested (in order)
        self.workers = EnvWorkers(config.num_env_workers)
        self.token_versions: Callable[[str, int, int], list[int]] | None = None

    def _new_run(self, group: EpisodeGroup, k: int, j: int, env: Env) -> _Run:
        turns = getattr(env, "max_turns", 1)
        if self.config.max_turns is not None:
            turns = min(turns, self.config.max_turns)
        stop = list(getattr(env, "stop", ()) or ())
        batched = callable(getattr(type(env), "step_batch", None))
        return _Run(Episode(group.index, j, group.seed), k, env, max(1, turns), stop, batched=batched)

    def run(self) -> list[Episode]:
        runs = [r for g in self.groups for r in g]
        try:
            for group in self.groups:
                for r in group:
                    args = (r.env, r.episode.env_seed, self.tokenizer, self._max_chars, self.config.chat)
                    self._call(r, "reset", reset_call, *args)
            while self.waiting:  # every reset first: the first turns enter the engine together, in group order
                self._check_stop()
                self._collect_calls()
                if self.waiting:
                    wait([r.call.future for r in self.waiting], WAIT_SLICE_S, FIRST_COMPLETED)  # type: ignore[union-attr]
            while any(r.live for r in runs):
                self._check_stop()
                self._collect_calls()
                if self.requests:
                    for out in self.engine.step(stream=False):
                        if out.finished and out.request_id in self.requests:
                            self._on_output(out)
                elif self.waiting:
                    wait([r.call.future for r in self.waiting], WAIT_SLICE_S, FIRST_COMPLETED)  # type: ignore[union-attr]
                elif self.pending:
                    self._step_pending()
                elif any(r.live for r in runs):  # liveness: a live episode always waits on a request or a call
                    raise RuntimeError("episodes in flight wait on nothing (a bug in the episode driver)")
        finally:
            self._release()
        for r in runs:
            r.episode.drift = bool(r.episode.token_ids) and has_drift(self.tokenizer, r.episode.token_ids)
        return [r.episode for r in runs]

    def _check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise EpisodesInterrupted("stopped waiting for the episodes")

    @property
    def _max_chars(self) -> int:
        return self.config.max_observation_chars

    def _release(self) -> None:
        """Abort the requests and abandon the calls still out (an interrupted or failed rollout)."""
        for rid in self.requests:
            self.engine.abort(rid)
        if self.requests:
            self.engine.step(stream=False)  # hands the aborted requests back: the engine holds none of ours
        self.requests.clear()
        for r in self.waiting:
            self.workers.abandon(r.call)  # type: ignore[arg-type]
        self.workers.close()

    # ---- environment calls ----
    def _call(self, run: _Run, what: str, fn: Callable[..., Any], *args: Any) -> None:
        run.call, run.calling = self.workers.submit(fn, *args), what
        self.waiting.append(run)

    def _collect_calls(self) -> None:
        """Take the answers that arrived; fail the calls past their timeout."""
        now, calls, self.waiting = time.monotonic(), self.waiting, []
        for r in calls:
            call = r.call
            assert call is not None
            if not call.future.done() and not call.overdue(self.config.env_timeout_s, now):
                self.waiting.append(r)
                continue
            r.call = None
            if not call.future.done():
                self.workers.abandon(call)
                self._fail(r, f"env.{r.calling} did not return within {self.config.env_timeout_s:g} s")
            elif (error := call.future.exception()) is not None:
                self._fail(r, f"env.{r.calling} raised {type(error).__name__}: {error}")
            elif r.calling == "step":
                self._on_answer(r, *call.future.result())
            else:
                self._on_reset(r, *call.future.result())
        while self.started < len(self.groups) and all(r.call is None for r in self.groups[self.started]):
            self._start_group(self.groups[self.started])  # every reset of the group is back: its first turn
            self.started += 1  # in group order, whatever order the resets came back in: the same engine batches

    def _on_reset(self, run: _Run, ids: list[int], history: list | None) -> None:
        e = run.episode
        e.token_ids, e.mask, e.engine_logprobs = list(ids), [0] * len(ids), [0.0] * len(ids)
        e.prompt_len, run.history = len(ids), history

    def _start_group(self, group: list[_Run]) -> None:
        live = [r for r in group if r.live]
        if not live:
            return
        prompt = live[0].episode.token_ids
        for r in live[1:]:
            if r.episode.token_ids != prompt:
                self._fail(r, "env.reset(seed) gave another first observation than sample 0's for the same seed")
        if len(prompt) >= self.limit:
            for r in live:
                self._fail(r, f"the first observation ({len(prompt)} tokens) leaves no room in {self.limit} tokens")
            return
        g = live[0].episode
        self._request(group, prompt, len(group), sample_seed(self.seed, self.step, g.env_index), live[0].stop)

    def _request(self, runs: list[_Run], prompt: list[int], n: int, seed: int, stop: list[str]) -> None:
        params = SamplingParams(
            n=n,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            max_tokens=min(self.config.max_new_tokens, self.limit - len(prompt)),
            seed=seed,
            stop=stop or None,
            include_stop_str_in_output=True,  # the closing tag is part of the turn
            logprobs=0,
            logprobs_mode="processed",  # of the tempered distribution the tokens were drawn from
        )
        rid = f"episode-{next(_request_ids)}"
        self.engine.add_request(rid, list(prompt), params)
        self.requests[rid] = runs

    # ---- turns ----
    def _on_output(self, out: RequestOutput) -> None:
        runs = self.requests.pop(out.request_id)
        for c in out.outputs:
            run = runs[c.index] if len(runs) > 1 else runs[0]
            if not run.live:
                continue
            if out.error or c.finish_reason in ("abort", "error"):
                self._fail(run, f"the engine failed the turn: {out.error or c.finish_reason}")
            else:
                self._on_turn(run, c, out.request_id)

    def _on_turn(self, run: _Run, c: CompletionOutput, request_id: str) -> None:
        e, ids = run.episode, list(c.token_ids)
        if self.token_versions is not None:
            e.versions += self.token_versions(request_id, c.index, len(ids))
        logprobs = [lp[t] for t, lp in zip(ids, c.logprobs or [])]
        e.token_ids += ids
        e.mask += [1] * len(ids)
        e.engine_logprobs += logprobs
        e.turn_ends.append(len(e.token_ids) - 1)
        e.turn_texts.append(c.text)
        e.num_turns += 1
        ended_on_eos = bool(ids) and ids[-1] in self.engine.eos_ids
        action = Action(c.text, ids)
        if run.batched:
            self.pending.append((run, action, ended_on_eos))
            return
        args = (action, run.history, self.tokenizer, self._max_chars, ended_on_eos, self.config.chat)
        self._call(run, "step", lambda: step_answer(run.env.step(action), *args))

    def _step_pending(self) -> None:
        """Step the batched environments' turns, once nothing else is in flight, in one call per class
        (:func:`spinwheel.envs.step_batch`: a one-step environment's reward function sees the whole batch, as a
        reward is called today). A failing batch call (a :class:`~spinwheel.rl.llm.rewards.RewardError`, or a
        Ctrl-C while it waits) fails the rollout: it is raised."""
        pending, self.pending = self.pending, []
        start = time.perf_counter()
        steps = step_batch(
            [r.env for r, _, _ in pending],
            [a for _, a, _ in pending],
            timeout_s=self.config.batch_timeout_s,
            should_stop=self.should_stop,
        )
        self.batch_step_s += time.perf_counter() - start
        for (r, action, eos), result in zip(pending, steps):
            try:
                answer = step_answer(result, action, r.history, self.tokenizer, self._max_chars, eos, self.config.chat)
            except EnvCallError as e:
                self._fail(r, f"env.step: {e}")
            else:
                self._on_answer(r, *answer)

    def _on_answer(self, run: _Run, ids: list[int] | None, history, reward: float, done: bool, info) -> None:
        e = run.episode
        e.turn_rewards.append(reward)
        e.info.update(info)
        if not finite_float32(math.fsum(e.turn_rewards)):  # each turn's is; their sum may not be
            return self._fail(run, f"env.step: the episode's total reward {math.fsum(e.turn_rewards):.3g} is past "
                              "float32's range (±3.4e38)")  # fmt: skip
        if done:
            return self._finish(run, "done")
        if e.num_turns >= run.max_turns:
            return self._finish(run, "max_turns")
        assert ids is not None
        if len(e.token_ids) + len(ids) >= self.limit:  # no room for the observation and one sampled token
            return self._finish(run, "max_tokens")
        run.history = history
        e.token_ids += ids
        e.mask += [0] * len(ids)
        e.engine_logprobs += [0.0] * len(ids)
        seed = turn_seed(self.seed, self.step, e.env_index, e.sample_index, e.num_turns)
        self._request([run], e.token_ids, 1, seed, run.stop)

    def _finish(self, run: _Run, reason: str) -> None:
        e = run.episode
        e.end_reason, e.done, e.truncated = reason, reason == "done", reason in ("max_turns", "max_tokens")
        e.reward = math.fsum(e.turn_rewards)
        run.live = False

    def _fail(self, run: _Run, error: str) -> None:
        self._finish(run, "failed")
        run.episode.failed, run.episode.error = True, error.splitlines()[0] if error else "failed"


__all__ = [
    "Episode",
    "EpisodeConfig",
    "EpisodeGroup",
    "EpisodesInterrupted",
    "EnvCallError",
    "prefill_counts",
    "run_episodes",
    "turn_seed",
]
