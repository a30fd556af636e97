"""A rollout rank's side of the disaggregated placement (:mod:`~spinwheel.rl.llm.rollouts.rollout_ranks`, whose
docstring
describes the schedule): the engine, the receiver thread that takes each weight broadcast into a
:class:`~spinwheel.rl.llm.rollouts.async_rollouts.WeightBox`, and the loop that plays the rank's share of each step and
sends
it to trainer rank 0, with the seeds of :func:`~spinwheel.rl.llm.rollouts.episode_source.step_seeds` (the same on every
rank and in one process).

A rollout rank waits for the trainer at most twice ``--timeout-s``: the next weights come after the slowest rollout
rank's batch (which the trainer itself waits for at most ``--timeout-s``) and the trainer's update (and, every
``--eval-every`` steps, its evaluation), so a rank that finished first never gives up on a trainer that is only
waiting for another rank; a trainer that hangs is still noticed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from spinwheel.engine import LLM
from spinwheel.models.hf import load_model
from spinwheel.models.tokenizer import load_tokenizer
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.episodes import EpisodesInterrupted
from spinwheel.rl.llm.rewards import RewardError, RewardInterrupted
from spinwheel.rl.llm.rollouts.async_rollouts import Closed, VersionedEngine, WeightBox, _EngineRef
from spinwheel.rl.llm.rollouts.episode_source import step_seeds
from spinwheel.rl.llm.rollouts.rollout_ranks import STOP, Placement
from spinwheel.rl.llm.rollouts.rollout_wire import (
    EPISODES,
    FAILED,
    LinkError,
    broadcast_weights,
    error_message,
    pack_episodes,
    send_message,
    wait,
)
from spinwheel.rl.llm.run_envs import play_share, run_environments
from spinwheel.train.interrupt import Interrupted, StopOnSignal


class WeightReceiver:
    """A rollout rank's receiver thread: takes each broadcast of weights into a staging copy and publishes it to
    ``box``; closes the box at the run's end (``code``) or on a failed wait (``error``)."""

    def __init__(self, place: Placement, state: dict[str, torch.Tensor]) -> None:
        self.place, self.names = place, sorted(k for k in state if not k.startswith("rotary."))
        self.like = [state[k] for k in self.names]  # shapes and dtypes of what arrives
        self.box = Received(0)
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)  # started later

    def header(self) -> list[int]:
        h = torch.zeros(5, dtype=torch.long, device=self.place.device)
        work = dist.broadcast(h, src=0, group=self.place.link, async_op=True)
        wait(work, self.place.timeout_s, "trainer rank 0 sent no weights", times=2)  # module docstring
        return h.tolist()

    def receive(self, version: int) -> list[torch.Tensor]:
        """The weights of ``version``, into fresh tensors (the engine may still be loading the previous ones)."""
        into = [torch.empty_like(t) for t in self.like]
        recv = lambda b: wait(  # noqa: E731
            dist.broadcast(b, src=0, group=self.place.link, async_op=True),
            self.place.timeout_s,
            f"trainer rank 0 broke off the weights of version {version}",
        )
        broadcast_weights(into, False, recv, device=self.place.device)
        return into

    def _run(self) -> None:
        try:
            while True:
                kind, version, _, code, _ = self.header()
                if kind == STOP:
                    self.code = code
                    return
                self.box.put(version, dict(zip(self.names, self.receive(version))))
        except BaseException as e:  # noqa: BLE001 - the rank's main thread raises it
            self.error = e
        finally:
            self.box.close()


class Received(WeightBox):
    """The rollout rank's weight box: versions arrive as received tensors (no copy of a trainer's model)."""

    def put(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self.version, self.state = version, state
            self._cond.notify_all()


def serve_rollouts(config: RLConfig, place: Placement) -> dict[str, Any]:
    """A rollout rank's run (module docstring): its engine takes the run's start from trainer rank 0, then plays
    its share of steps ``first .. end − 1``, each once version ``step − K`` arrived, and sends each batch."""
    model, tokenizer, make_env = _rollout_parts(config)
    receiver = WeightReceiver(place, model.state_dict())
    kind, first, end, code, context = receiver.header()
    if kind == STOP:  # the trainer ended before its first step: a finished run (0), or an error
        if code:
            raise ValueError("the trainer stopped with an error (rank 0 says which)")
        return {"rollout_rank": place.rank, "steps": 0}
    llm = _engine(config, model, tokenizer, context)
    llm.update_weights(dict(zip(receiver.names, receiver.receive(first))))
    receiver.box = box = Received(first)
    engine = VersionedEngine(llm.engine, box, first, config.kv_on_update)  # --kv-on-update: keep or recompute KV
    receiver.thread.start()
    played, failure = 0, None
    with StopOnSignal(False):  # Ctrl-C / SIGTERM: the trainer stops the run after its step and tells this rank
        try:
            played, failure = _play_steps(config, place, engine, make_env, first, end)
        except Closed:
            pass
        except LinkError:
            receiver.thread.join()
            if receiver.code is None:
                raise
            # else the trainer ended first and said how (below): the broken link is its consequence
        receiver.thread.join()  # bounded: the receiver's every wait has the timeout
    if receiver.error is not None:
        raise receiver.error
    if receiver.code and receiver.code > 128:
        raise Interrupted(receiver.code - 128, first + played)
    if failure is not None:
        raise failure
    if receiver.code:
        raise ValueError("the trainer stopped with an error (rank 0 says which)")
    return {"rollout_rank": place.rank, "steps": played}


def _rollout_parts(config: RLConfig):
    """(a model of the run's shape, the tokenizer, the environments' factory), as the trainer's."""
    tokenizer = load_tokenizer(config.model)
    load = dict(dtype=config.dtype, device=config.device, seed=config.seed, vocab_size=tokenizer.vocab_size)
    model = load_model(config.model, **load).requires_grad_(False)
    make_env, _ = run_environments(config, tokenizer, model.config.max_position_embeddings, lambda line: None)
    return model, tokenizer, make_env


def _engine(config: RLConfig, model, tokenizer, context: int):
    """The rank's engine with the trainer's engine options (``context``: the trainer's ``max_model_len``)."""
    options = {**dataclasses.asdict(config.engine), "max_model_len": context, "seed": config.seed}
    return LLM(model, tokenizer, **options)


def _play_steps(config: RLConfig, place: Placement, engine: VersionedEngine, make_env, first: int, end: int):
    """Play and send steps ``first .. end − 1``; returns (steps sent, the error that failed a step or None). At most
    K + 1 batches are in flight; the waits for them have the timeout."""
    k, box = config.max_staleness or 0, engine.box
    share = SimpleNamespace(dp_axis=SimpleNamespace(size=place.rollout, rank=place.rollout_index))
    num_train = getattr(make_env("train"), "num_tasks", None)
    pending: list = []
    for step in range(first, end):
        start = time.perf_counter()
        box.wait_for(step - k)
        ready, figures = time.perf_counter(), {}
        seeds = step_seeds(config, num_train, step)
        try:
            episodes = play_share(_EngineRef(engine), make_env, seeds, step, config, share,  # type: ignore[arg-type]
                                  lambda: box.closed, figures, token_versions=engine.token_versions)  # fmt: skip
        except (RewardError, RewardInterrupted, EpisodesInterrupted) as e:
            if box.closed:
                raise Closed from None
            message = send_message(FAILED, step, error_message(str(e)), 0, place.episodes, place.device)
            _wait_sent([message], place, step)
            return step - first, e
        engine.forget()
        played, score = time.perf_counter() - ready, figures.get("batch_step_s", 0.0)
        times = {"generate": played - score, "score": score, "wait_weights": ready - start,
                 "weight_swaps": engine.num_swaps, "kv_recomputed": engine.num_recomputed}  # fmt: skip
        pending.append(send_message(EPISODES, step, pack_episodes(episodes, times), 0, place.episodes, place.device))
        if len(pending) > k + 1:
            _wait_sent([pending.pop(0)], place, step)
    _wait_sent(pending, place, end - 1)
    return end - first, None


def _wait_sent(messages: list, place: Placement, step: int) -> None:
    for works, *_ in messages:
        for work in works:
            wait(work, place.timeout_s, f"trainer rank 0 took no episodes of step {step}", times=2)
