"""The asynchronous :class:`~spinwheel.rl.llm.rollouts.protocol.Rollouts`: a producer thread that runs ahead of the
trainer
(:class:`RolloutProducer`, ``--max-staleness K``), as AReaL and PipelineRL overlap generation with training.

The asynchronous schedule, in one process. *Version* v names the weights after v updates, which the synchronous loop
samples step v with. The producer plays step s once version ``s − K`` is published (:class:`WeightBox`), on an engine
that holds its own copy of the weights, and hands finished step batches to the trainer through a queue of at most
K + 1. After each update the trainer publishes version v + 1 (a detached copy); the producer loads it between two
engine steps without stopping (:class:`VersionedEngine`: PipelineRL's in-flight update — running sequences go on
under the new weights with the KV their prefix computed under the old ones, "stale KV"; a prefix block registered in
the prefix cache before the swap may serve a later request too) and records for every sampled token the version
that sampled it. With ``--kv-on-update recompute`` the swap instead preempts every running sequence by recompute
(:meth:`~spinwheel.engine.scheduler.Scheduler.recompute_all`): each is prefilled again, prompt and sampled tokens,
under the new weights, so a token's log-prob is its version's given the whole prefix under that version. Either
way a request added after a swap is never served old K/V by the prefix cache. At training step s a token of
version v is ``s − v`` versions stale; an episode whose oldest token is more than K stale is dropped and counted
(:func:`staleness_figures`). With K = 0 the producer waits for version s before it samples step s: the synchronous
run, bit for bit. With ``--rollout-engine process`` the engine steps in a child process
(:mod:`~spinwheel.rl.llm.rollouts.rollout_engine`); the trainer waits at most ``--timeout-s`` for a batch.

With K >= 1 the producer and the trainer each take half the torch threads (they compute at once; on a shared CPU
more threads than cores only spin at OpenMP barriers).

On resume the producer starts again at the checkpoint's step from the checkpoint's weights: what it had played
ahead (at most K + 1 steps, none of them trained) is played again — for K = 0 exactly as the uninterrupted run did,
for K > 0 on weights as new as the checkpoint's, which may be newer than those the first attempt used.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spinwheel.engine import LLM
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.episode_tokens import Episode
from spinwheel.rl.llm.rollouts.protocol import Rollout, module_mb
from spinwheel.rl.llm.rollouts.weight_sync import state_bytes, sync_state

KV_ON_UPDATE = ("keep", "recompute")  # what a weight swap does to the K/V of the sequences it finds running
POLL_S = 0.5  # how often a waiting trainer checks that the producer is alive
MAX_RESTARTS = 3  # engine-process restarts within one step before the step fails


Play = Callable[..., tuple[list[Episode], float]]  # (step, llm=, token_versions=) -> (episodes, reward seconds)


class Closed(Exception):
    """The producer was closed while it waited."""


class WeightBox:
    """The newest weights the trainer published and their version; a waiter blocks until a version arrives."""

    def __init__(self, version: int) -> None:
        self._cond = threading.Condition()
        self.version, self.state, self.closed = version, None, False
        self.sent_bytes = 0  # what the last publish sent (weight_sync.engine_sync_figures)

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Copy ``model``'s weights (the trainer goes on updating its own in place) as ``version``."""
        state = sync_state(model)  # with LoRA the adapters alone: the engine copy holds the frozen base
        self.sent_bytes = state_bytes(state)
        with self._cond:
            self.version, self.state = version, state
            self._cond.notify_all()

    def latest(self) -> tuple[int, dict[str, torch.Tensor] | None]:
        with self._cond:
            return self.version, self.state

    def wait_for(self, version: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.closed or self.version >= version)
            if self.closed:
                raise Closed

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class VersionedEngine:
    """The producer's engine: before each step it loads the newest published weights (running sequences keep
    their KV) and it keeps, per request, the version its tokens started under and the output length of each
    sample at every later swap — what :meth:`token_versions` turns into one version per sampled token."""

    def __init__(self, engine: Any, box: WeightBox, version: int, kv: str = "keep") -> None:
        if kv not in KV_ON_UPDATE:
            raise ValueError(f"--kv-on-update must be one of {', '.join(KV_ON_UPDATE)}, got {kv!r}")
        self.inner, self.box, self.version, self.kv = engine, box, version, kv
        self.num_swaps = self.num_recomputed = 0  # weight swaps; groups whose K/V a swap made recompute
        self._start: dict[str, int] = {}  # request id -> the version current when it was added
        self._marks: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (id, sample) -> [(tokens before, version)]
        self.load_s = 0.0  # the last swap's seconds (weight_sync.engine_sync_figures)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def add_request(self, request_id: str, prompt: Any, params: Any = None, arrival_time: float | None = None) -> None:
        self._start[request_id] = self.version
        self.inner.add_request(request_id, prompt, params, arrival_time)

    def step(self, stream: bool = True) -> list:
        version, state = self.box.latest()
        if version > self.version and state is not None:
            self._mark(version)
            start = time.perf_counter()
            self.inner.update_weights(state)  # copies into the engine's weights; drops the prefix cache
            self.load_s = time.perf_counter() - start
            if self.kv == "recompute":  # every running sequence is prefilled again under the new weights
                self.num_recomputed += self.inner.scheduler.recompute_all()
            self.version, self.num_swaps = version, self.num_swaps + 1
        return self.inner.step(stream)

    def _mark(self, version: int) -> None:
        """Record, for every unfinished request, where the new version's tokens begin."""
        sch = self.inner.scheduler
        for group in [*sch.running, *sch.swapped, *sch.waiting]:
            if all(s.num_output_tokens == 0 for s in group.seqs):  # nothing sampled yet (forks come later)
                self._start[group.request_id] = version
                continue
            for s in group.seqs:
                self._marks.setdefault((group.request_id, s.index), []).append((s.num_output_tokens, version))

    def token_versions(self, request_id: str, index: int, num_tokens: int) -> list[int]:
        """The version that sampled each of the ``num_tokens`` tokens of sample ``index`` of a finished request."""
        versions = [self._start[request_id]] * num_tokens
        for before, version in self._marks.pop((request_id, index), []):
            versions[before:] = [version] * (num_tokens - before)
        return versions

    def forget(self) -> None:
        self._start.clear()
        self._marks.clear()


class RolloutProducer:
    """The producer thread (module docstring): plays steps ``first .. end − 1`` with ``play``, each once version
    ``step − max_ahead`` is published; :meth:`take` hands the trainer the next batch (or raises what the producer
    raised: a failed step fails the trainer's step, before any weight changed). ``engine``: an engine in this
    process, or an :class:`~spinwheel.rl.llm.rollouts.rollout_engine.EngineProcess` (restarted when it dies, the step
    played
    again). The trainer waits at most ``timeout_s`` for a batch. ``evaluation``: held-out episodes on an engine of
    its own over the trainer's weights (:class:`EvalEngine`)."""

    engine_copy_mb = 0.0

    def __init__(
        self, play: Play, engine: Any, first: int, end: int, max_ahead: int, kv: str = "keep",
        timeout_s: float | None = None, evaluation: Callable[[int], list[Episode]] | None = None,
    ) -> None:  # fmt: skip
        self.play, self.first, self.end, self.max_ahead, self.timeout_s = play, first, end, max_ahead, timeout_s
        self.evaluation = evaluation
        self.llm = _EngineRef(engine)  # the engine (without its versions) the producer plays on
        self.box = WeightBox(first)
        remote = getattr(engine, "versioned", None)
        self.engine = remote(self.box, first, kv) if remote else VersionedEngine(engine, self.box, first, kv)
        self.queue: queue.Queue = queue.Queue(maxsize=max_ahead + 1)
        # A thread's own count (OpenMP). K = 0 never overlaps: the producer takes the trainer's count (the same
        # numerics as the synchronous loop); K >= 1 splits the threads between the two, which run at once.
        self.trainer_threads = torch.get_num_threads()
        self.num_threads = producer_threads(max_ahead)
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self.started = False
        self.regenerated = 0  # episodes played again after the engine process died

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            for step in range(self.first, self.end):
                start = time.perf_counter()
                self.box.wait_for(step - self.max_ahead)
                ready = time.perf_counter()
                episodes, score_s = self._play(step)
                self.engine.forget()
                played = time.perf_counter() - ready
                times = {"generate": played - score_s, "score": score_s, "wait_weights": ready - start}
                self._put(Rollout(step, episodes, times))
        except Closed:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it in its step
            if not self.box.closed:
                self._put(e)

    def _play(self, step: int) -> tuple[list[Episode], float]:
        """The step's episodes; when the engine process dies meanwhile, on a new one, from the step's start (the
        episodes of the lost attempt are counted in ``regenerated``; the trainer saw none of them)."""
        from spinwheel.rl.llm.rollouts.rollout_engine import EngineDied

        for attempt in range(MAX_RESTARTS + 1):
            try:
                llm, versions = _EngineRef(self.engine), self.engine.token_versions
                episodes, score_s = self.play(step, llm=llm, token_versions=versions)
                if attempt:
                    self.regenerated += len(episodes)
                return episodes, score_s
            except EngineDied:
                if self.box.closed or attempt == MAX_RESTARTS:
                    raise
                self.engine.restart()
        raise AssertionError("unreachable")

    def _put(self, item: Rollout | BaseException) -> None:
        while not self.box.closed:
            try:
                self.queue.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def take(self, step: int) -> Rollout:
        if not self.started:  # lazily: the run's first evaluation has the machine to itself
            if self.max_ahead > 0:
                torch.set_num_threads(max(1, self.trainer_threads - self.num_threads))
            self.thread.start()
            self.started = True
        start = time.perf_counter()
        while True:
            try:
                item = self.queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("the rollout producer stopped without a batch (a bug)") from None
                if self.timeout_s and time.perf_counter() - start > self.timeout_s:
                    raise TimeoutError(
                        f"the rollout producer handed no batch for step {step} in {self.timeout_s:g} s (--timeout-s): "
                        "it hangs; the run stops"
                    ) from None
        if isinstance(item, BaseException):
            raise item
        if item.step != step:
            raise RuntimeError(f"the rollout producer handed step {item.step} for step {step} (a bug)")
        item.times["wait_rollout"] = time.perf_counter() - start
        return item

    def publish(self, version: int, model: torch.nn.Module) -> None:
        self.box.publish(version, model)

    def figures(self) -> dict[str, float]:
        """The step's figures: cumulative weight swaps and groups whose KV a swap recomputed, with the engine process
        its restarts, the episodes played again and the weights copied to it (seconds, MiB); the last update's
        bytes and load seconds."""
        e = self.engine
        out = {"weight_swaps": float(e.num_swaps), "kv_recomputed": float(e.num_recomputed)}
        if hasattr(e, "restarts"):
            out.update(engine_restarts=float(e.restarts), regenerated_samples=float(self.regenerated))
            out.update(weight_publish_s=e.publish_s, weight_publish_mb=e.published_bytes / 2**20)
        out["sync_bytes"] = float(self.box.sent_bytes)  # the last update's (weight_sync.py)
        out["sync_load_s"] = float(e.load_s)  # the last swap's seconds (in a child: its copy's)
        return out

    def evaluate(self, num: int) -> list[Episode] | None:
        return self.evaluation(num) if self.evaluation is not None else None

    def close(self) -> None:
        self.box.close()
        if hasattr(self.engine, "kill"):  # no call from this thread on the producer's pipe: the child is ended,
            self.engine.kill()  # a producer waiting on it gets EngineDied and, closed, returns
        while not self.queue.empty():
            self.queue.get_nowait()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        if self.started:
            torch.set_num_threads(self.trainer_threads)


def producer_threads(max_ahead: int) -> int:
    """The producer's torch threads: all of them at K = 0 (no overlap: the synchronous numerics), half at K >= 1."""
    return torch.get_num_threads() if max_ahead == 0 else max(1, torch.get_num_threads() // 2)


def make_producer(
    config: RLConfig, source: Any, model: torch.nn.Module, tokenizer: Any, options: dict, first: int, end: int
) -> RolloutProducer:
    """The producer of ``--max-staleness``: the engine on a copy of ``model``'s weights, in this process or
    (``--rollout-engine process``) in a child; evaluation on an engine of its own over ``model``."""
    k, kv, timeout = config.max_staleness, config.kv_on_update, config.parallel.timeout_s
    if config.rollout_engine == "process":
        from spinwheel.rl.llm.rollouts.rollout_engine import EngineProcess

        wrap = (VersionedEngine, WeightBox)
        engine: Any = EngineProcess(model, tokenizer, options, first, kv, producer_threads(k), timeout, wrap)
    else:
        engine = LLM(copy.deepcopy(model).requires_grad_(False), tokenizer, **options).engine
    evaluation = EvalEngine(source, model, tokenizer, options)
    producer = RolloutProducer(source.play, engine, first, end, k, kv, timeout, evaluation)
    producer.engine_copy_mb = module_mb(engine.model)
    return producer


class EvalEngine:
    """Evaluation beside the producer: an engine of its own on the trainer's weights (``model``), built at the
    first evaluation and given the current weights at each later one."""

    def __init__(self, source: Any, model: torch.nn.Module, tokenizer: Any, options: dict) -> None:
        self.source, self.model, self.tokenizer, self.options = source, model, tokenizer, options
        self.llm: LLM | None = None

    def __call__(self, num: int) -> list[Episode]:
        if self.llm is None:
            self.llm = LLM(self.model, self.tokenizer, **self.options)
        else:
            self.llm.update_weights(self.model)  # updated since the last evaluation
        return self.source.held_out(self.llm, num)


@dataclass
class _EngineRef:
    """What :func:`~spinwheel.rl.llm.run_envs.play_share` plays on: an object with ``.engine``."""

    engine: Any
