"""Environment calls off the engine's critical path, and the checks on what an environment returns.

``reset`` and ``step`` run on :class:`EnvWorkers`, a small pool of daemon threads handing back
:class:`concurrent.futures.Future` objects, while the rollout driver keeps stepping the engine. It is not a
:class:`~concurrent.futures.ThreadPoolExecutor` because a call can hang: a thread cannot be killed, and an executor
joins its workers at interpreter exit (a hung environment would hang the run's exit) and loses a worker for good.
Here a call past its timeout is abandoned: its daemon thread is left to finish (or die with the process) and a fresh
worker takes its place, so the pool keeps its size.

What comes back is checked before the rollout uses it (:func:`checked_step`, :func:`checked_observation`): a
``Step``-shaped object, a finite real reward, an observation that is text or chat messages under the size cap. A
failed check is an :class:`EnvCallError`, which fails that episode only.
"""

from __future__ import annotations

import math
import numbers
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from spinwheel.envs.base import Action, Env, Message, Observation
from spinwheel.envs.chat import ChatFormat
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.rl.llm.episode_tokens import first_tokens, observation_tokens
from spinwheel.rl.llm.rewards import finite_float32


class EnvCallError(ValueError):
    """An environment's answer that the rollout cannot use (one line, naming what is wrong)."""


@dataclass
class EnvCall:
    """One submitted call: its future, and when a worker started it (None while it waits in the queue)."""

    future: Future = field(default_factory=Future)
    started: float | None = None

    def overdue(self, timeout_s: float | None, now: float) -> bool:
        return timeout_s is not None and self.started is not None and now - self.started > timeout_s


class EnvWorkers:
    """``num_workers`` daemon threads taking calls from one queue (see the module docstring)."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._surplus = 0  # workers to retire: abandoned ones that came back after their replacement started
        self.num_abandoned = 0
        self._num_live = 0
        for _ in range(num_workers):
            self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            self._num_live += 1
        threading.Thread(target=self._work, name="spinwheel env worker", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                with self._lock:
                    self._num_live -= 1
                return
            call, fn, args = job
            if not call.future.set_running_or_notify_cancel():
                continue
            call.started = time.monotonic()
            try:
                call.future.set_result(fn(*args))
            except BaseException as e:  # SystemExit too: an environment ends its own call, never the run
                call.future.set_exception(e)
            with self._lock:
                if self._surplus > 0:
                    self._surplus -= 1
                    self._num_live -= 1
                    return

    def submit(self, fn: Callable[..., Any], *args: Any) -> EnvCall:
        call = EnvCall()
        self._jobs.put((call, fn, args))
        return call

    def abandon(self, call: EnvCall) -> None:
        """Give up on ``call`` (past its timeout, or the rollout stops): a worker stuck in it is replaced."""
        if call.future.cancel() or call.future.done():
            return
        self.num_abandoned += 1
        with self._lock:
            self._surplus += 1  # the stuck worker retires if it ever returns
        self._spawn()

    def close(self) -> None:
        """Let the idle workers exit (busy ones exit after their call; all are daemons)."""
        with self._lock:
            live = self._num_live
        for _ in range(live):
            self._jobs.put(None)


def checked_observation(obs: Any, max_chars: int) -> Observation:
    """``obs`` if it is text or a list of ``{"role", "content"}`` messages of at most ``max_chars`` characters."""
    if isinstance(obs, str):
        size = len(obs)
    elif isinstance(obs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in obs
    ):
        size = sum(len(m["content"]) for m in obs)
    else:
        raise EnvCallError(f"observation must be text or a list of chat messages, got {type(obs).__name__}")
    if size > max_chars:
        raise EnvCallError(f"observation of {size} characters is over the cap of {max_chars}")
    return obs


def checked_step(result: Any) -> tuple[Any, float, bool, dict[str, float]]:
    """(observation, reward, done, info) of a ``Step``-shaped answer; the reward a finite real number, info's
    entries that are finite numbers as floats (others dropped: they are figures to log)."""
    try:
        obs, reward, done, info = result.observation, result.reward, result.done, result.info
    except AttributeError:
        raise EnvCallError(f"step must return a Step (observation, reward, done, info), got {result!r:.80}") from None
    if not isinstance(reward, numbers.Real) or not finite_float32(reward):
        raise EnvCallError(f"reward must be a finite number within float32's range (±3.4e38), got {reward!r:.40}")
    figures = {}
    for key, value in (info or {}).items() if isinstance(info, dict) else ():
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            figures[str(key)] = float(value)
    return obs, float(reward), bool(done), figures


def reset_call(
    env: Env, seed: int, tokenizer: Tokenizer, max_chars: int, chat: ChatFormat | None = None
) -> tuple[list[int], list[Message] | None]:
    """On a worker: reset, check and tokenize the first observation (its tokens, and the chat history if any;
    ``chat``: raw text rendered as chat turns)."""
    return first_tokens(tokenizer, checked_observation(env.reset(seed), max_chars), chat)


def step_answer(
    result: Any,
    action: Action,
    history: list[Message] | None,
    tokenizer: Tokenizer,
    max_chars: int,
    ended_on_eos: bool,
    chat: ChatFormat | None = None,
) -> tuple[list[int] | None, list[Message] | None, float, bool, dict[str, float]]:
    """On a worker (or after a batched step): check ``env.step``'s ``result`` and tokenize the observation unless
    the episode is done: (observation tokens, chat history after them, reward, done, info)."""
    obs, reward, done, info = checked_step(result)
    if done:
        return None, history, reward, done, info
    ids, history = observation_tokens(
        tokenizer, checked_observation(obs, max_chars), history, action.text, ended_on_eos, chat
    )
    return ids, history, reward, done, info
