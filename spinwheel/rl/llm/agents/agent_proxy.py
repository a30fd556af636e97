"""Black-box agents (AReaL's proxy mode): an agent written against the OpenAI API, trained on the tokens it made
the policy sample.

An agent is a Python function ``agent(client: openai.OpenAI, task: dict) -> float``: it drives the model through the
client (``client.completions.create`` / ``client.chat.completions.create``, any number of calls, any tools of its
own) and returns the task's reward. :func:`play_agent_episodes` runs ``group_size`` agent runs per task:

1. :class:`PolicyServer` serves the current policy on a local base URL — spinwheel's own OpenAI-compatible server
   (:mod:`spinwheel.server`) on the trainer's engine, which reads the trainer's model object, in this process, on a
   free loopback port;
2. each run gets its own client, whose transport records the exact token ids and log-probs of every call
   (:class:`~spinwheel.rl.llm.agents.agent_calls.RecordingTransport`: the engine's ids, never a re-tokenisation);
3. the runs go on worker threads, ``num_workers`` at once, each with a deadline: an agent that raises, hangs past
   ``timeout_s``, returns something other than a finite number, or makes a call that cannot be recorded fails its
   episode, which is counted (``failed``, ``error``) and left out of the loss, as a failing environment's is;
4. each run becomes an :class:`~spinwheel.rl.llm.agents.agent_calls.AgentEpisode` (its calls chained into one token
   sequence, mask 1 on sampled tokens, the reward on the last call), in group-major order as
   :func:`~spinwheel.rl.llm.episodes.run_episodes` returns them, so ``episode_batch`` / ``episode_rewards`` and the
   GRPO loss take them as they are.

The model name in the agent's requests is ignored: every call is served by the current policy. The server lives for
one call of :func:`play_agent_episodes` (the weights must not change while it serves); when it stops, requests a
timed-out agent left in the engine are aborted, so the engine is idle for the trainer's next step.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from spinwheel.engine import LLM, LLMEngine
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.rl.llm.agents.agent_calls import AgentEpisode, RecordingTransport, agent_episode
from spinwheel.rl.llm.episodes import EpisodesInterrupted, turn_seed

Agent = Callable[[Any, dict], float]  # (openai.OpenAI, task) -> reward
POLICY_MODEL = "policy"  # the served model's name
MAX_ERROR_CHARS = 500


@dataclass
class AgentConfig:
    """How agent runs are bounded."""

    timeout_s: float = 120.0  # per agent run (its model calls included); past it the episode fails
    num_workers: int = 16  # agent runs at once (threads)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"AgentConfig.timeout_s must be > 0, got {self.timeout_s}")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"AgentConfig.num_workers must be an integer >= 1, got {self.num_workers!r}")


class PolicyServer:
    """The engine's model on ``base_url`` (``http://127.0.0.1:<free port>/v1``) while the context is open."""

    def __init__(self, llm: LLM | LLMEngine, model: str = POLICY_MODEL) -> None:
        from spinwheel.server import BackgroundServer, OpenAIServer

        self.engine = llm.engine if isinstance(llm, LLM) else llm
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the engine has requests in flight: serve it when it is idle")
        self.model = model
        self._server = BackgroundServer(OpenAIServer(self.engine, model))
        self.transport = httpx.HTTPTransport()  # the clients' connection pool (building one costs ~30 ms)

    @property
    def base_url(self) -> str:
        return self._server.url + "/v1"

    def __enter__(self) -> PolicyServer:
        self._server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.transport.close()
        self._server.__exit__(*exc)  # stops the HTTP server and the engine's serving thread
        for request_id in list(self.engine._groups):  # a timed-out agent's requests: the engine goes back idle
            self.engine.abort(request_id)
        while self.engine.has_unfinished_requests():
            self.engine.step(stream=False)


class _Run:
    """One agent run: its task, client and recorder; the episode once it finished or timed out."""

    def __init__(self, server: PolicyServer, task: dict, index: int, sample: int, seed: int, step: int) -> None:
        import openai

        self.task, self.index, self.sample = task, index, sample
        env_seed = task.get("seed", index)
        self.env_seed = env_seed if isinstance(env_seed, int) and not isinstance(env_seed, bool) else index
        seed_of = lambda k: turn_seed(seed, step, index, sample, k) % 2**63  # noqa: E731
        self.transport = RecordingTransport(server.transport, server.model, seed_of)
        self.http = httpx.Client(transport=self.transport, timeout=None)
        self.client = openai.OpenAI(base_url=server.base_url, api_key="spinwheel", max_retries=0, http_client=self.http)
        self.reward: object = None
        self.error: str | None = None
        self.deadline = float("inf")
        self.episode: AgentEpisode | None = None

    def start(self, agent: Agent, done: queue.SimpleQueue, timeout_s: float) -> None:
        def target() -> None:
            try:
                self.reward = agent(self.client, copy.deepcopy(self.task))
            except BaseException as e:  # noqa: BLE001 - any failure of the agent fails its episode only
                self.error = f"the agent raised {type(e).__name__}: {e}"[:MAX_ERROR_CHARS]
            finally:
                done.put(self)

        self.deadline = time.monotonic() + timeout_s
        threading.Thread(target=target, name=f"agent-{self.index}-{self.sample}", daemon=True).start()

    def finish(self, tokenizer: Tokenizer, timed_out: float | None = None) -> None:
        """Make the episode from what was recorded; ``timed_out``: the run's limit, which it passed."""
        self.transport.close_run()  # a hung agent's later calls are refused
        error = self.transport.error and f"a call cannot be recorded: {self.transport.error}"
        if timed_out is not None:
            error = f"the agent did not finish within {timed_out:g} s"
        error = error or self.error
        calls = list(self.transport.calls)
        self.episode = agent_episode(calls, self.reward, error, tokenizer, self.index, self.sample, self.env_seed)
        if timed_out is None:
            self.http.close()  # a timed-out run's client stays open under its thread, which may still use it


def play_agent_episodes(
    llm: LLM | LLMEngine,
    agent: Agent,
    tasks: Sequence[dict],
    group_size: int,
    seed: int = 0,
    step: int = 0,
    config: AgentConfig | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[AgentEpisode]:
    """``group_size`` runs of ``agent`` on each task, as episodes in group-major order (run ``j`` of task ``k`` at
    ``k * group_size + j``), the engine serving the current policy meanwhile (module docstring). A call without a
    seed gets ``turn_seed(seed, step, k, j, call index)``. ``should_stop()`` turning true raises
    :class:`~spinwheel.rl.llm.episodes.EpisodesInterrupted`."""
    config = config or AgentConfig()
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    with PolicyServer(llm) as server:
        assert server.engine.tokenizer is not None
        runs = [_Run(server, dict(t), k, j, seed, step) for k, t in enumerate(tasks) for j in range(group_size)]
        _drive(runs, agent, config, server.engine.tokenizer, should_stop)
    return [r.episode for r in runs if r.episode is not None]


def _drive(
    runs: list[_Run], agent: Agent, config: AgentConfig, tokenizer: Tokenizer, should_stop: Callable[[], bool] | None
) -> None:
    """Run the agents, ``num_workers`` at once, until each has finished or passed its deadline."""
    waiting, active, done = deque(runs), set(), queue.SimpleQueue()
    while waiting or active:
        if should_stop is not None and should_stop():
            for r in active:
                r.transport.close_run()
            raise EpisodesInterrupted("agent runs stopped")
        while waiting and len(active) < config.num_workers:
            r = waiting.popleft()
            r.start(agent, done, config.timeout_s)
            active.add(r)
        wait = min(r.deadline for r in active) - time.monotonic()
        try:
            r = done.get(timeout=max(0.0, min(wait, 0.25)))
            if r in active:
                active.discard(r)
                r.finish(tokenizer)
        except queue.Empty:
            pass
        now = time.monotonic()
        for r in [r for r in active if r.deadline <= now]:
            active.discard(r)
            r.finish(tokenizer, timed_out=config.timeout_s)


def load_agent(spec: str) -> Agent:
    """The agent function named by ``module:function`` or ``path/to/file.py:function``; a one-line error else."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--agent {spec!r}: give module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or module_spec.loader is None or not path.is_file():
                raise ImportError(f"no file {where}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as e:  # noqa: BLE001 - any import failure becomes one line
        raise ValueError(f"--agent {spec!r}: cannot import {where}: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--agent {spec!r}: {where} has no function {name}")
    return fn


def agent_metrics(episodes: Sequence[AgentEpisode]) -> dict[str, float]:
    """Per-step figures of the agent runs: model calls per run, and the runs whose calls did not chain into one
    token sequence (trained on their last segment)."""
    n = max(1, len(episodes))
    return {
        "agent_calls_mean": sum(e.info.get("agent_calls", 0.0) for e in episodes) / n,
        "agent_runs_split": float(sum(e.info.get("agent_segments", 1.0) > 1 for e in episodes)),
    }
