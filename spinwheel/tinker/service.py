"""The service's one worker: every request that touches the model runs here, on one thread, in an order that keeps
each training client's requests in the order it sent them while batching different clients together.

Each training client (model id) has a FIFO of jobs; sampling requests have their own. One round of the worker takes
the head job of every client: all heads that are ``forward_backward`` run as one batch (one forward and one backward
over every client's rows, :meth:`~spinwheel.tinker.trainer.Trainer.forward_backward`), ``forward`` heads as another
batch without gradients, ``optim_step`` heads as one fused AdamW over their clients' adapters
(:mod:`~spinwheel.tinker.optim`), and the other heads (saves, loads) one by one; then every pending sampling
request runs in the engine together. A job's exception fails its future alone (one request, one failure): the
request's own fault (bad shapes, an unknown loss, token ids outside the vocabulary, a missing checkpoint) with
category ``user``, anything else ``server``; the worker goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spinwheel.models.lora import LoRAError
from spinwheel.tinker.checkpoints import CheckpointPathError
from spinwheel.tinker.futures import FutureStore
from spinwheel.tinker.losses import LossInputError
from spinwheel.tinker.optim import AdamHP, adamw_steps
from spinwheel.tinker.sampler import Sampler
from spinwheel.tinker.trainer import Trainer, UnknownModelError
from spinwheel.tinker.wire import FwdBwdRequest, encode_forward_backward

logger = logging.getLogger("spinwheel.tinker")
ACTIVE_SECONDS = 2.0  # a training client whose last step ended this recently is waited for (see Worker._gather)
USER_ERRORS = (LossInputError, CheckpointPathError, LoRAError, UnknownModelError)


@dataclass
class Job:
    rid: str
    fwdbwd: FwdBwdRequest | None = None  # a forward / forward_backward request
    call: Callable[[], Any] | None = None  # anything else: its result is the future's value
    sample: tuple[str, dict] | None = None  # (sampling session id, SampleRequest)
    optim: tuple[str, AdamHP] | None = None  # (model id, Adam parameters): optim_step, batched across clients


@dataclass
class Queues:
    by_model: dict[str, deque[Job]] = field(default_factory=dict)
    samples: deque[Job] = field(default_factory=deque)


def fail(store: FutureStore, rid: str, e: BaseException) -> None:
    if isinstance(e, USER_ERRORS):
        store.set_error(rid, str(e), "user")
    else:
        logger.exception("request %s failed in the service", rid)
        store.set_error(rid, f"{type(e).__name__}: {e}", "server")


class Worker:
    def __init__(self, trainer: Trainer, sampler: Sampler, store: FutureStore, gather_ms: float = 0.0) -> None:
        self.trainer, self.sampler, self.store = trainer, sampler, store
        self.gather_s = gather_ms / 1000
        self._last_step: dict[str, float] = {}  # training client -> when its last forward_backward/optim_step ended
        self.queues = Queues()
        self._cond = threading.Condition()
        self._stop = False
        self.num_batches = 0  # forward_backward batches run (tests check that clients were batched)
        self.batch_sizes: list[int] = []
        self.optim_batch_sizes: list[int] = []  # optim_steps run together, per fused step
        self._thread = threading.Thread(target=self._run, name="tinker-worker", daemon=True)
        self._thread.start()

    def submit(self, model_id: str | None, job: Job) -> str:
        with self._cond:
            if model_id is None:
                self.queues.samples.append(job)
            else:
                self.queues.by_model.setdefault(model_id, deque()).append(job)
            self._cond.notify()
        return job.rid

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(30)

    def _gather(self) -> None:
        """Before a forward_backward batch, wait up to ``gather_s`` for the training clients that are between two
        steps (one ended within ACTIVE_SECONDS and nothing of theirs is queued): a client sends its next
        forward_backward only once its optim_step's result is back, so without the wait the first client to answer
        would run alone and the others one round later."""
        heads = [q[0] for q in self.queues.by_model.values() if q]
        if self.gather_s <= 0 or not any(j.fwdbwd is not None and not j.fwdbwd.forward_only for j in heads):
            return
        now = time.monotonic()
        deadline = now + self.gather_s
        self._last_step = {m: t for m, t in self._last_step.items() if now - t < ACTIVE_SECONDS}
        active = list(self._last_step)
        while not self._stop and any(not self.queues.by_model.get(m) for m in active):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _take(self) -> tuple[list[tuple[str, Job]], list[Job]] | None:
        with self._cond:
            while not self._stop and not self.queues.samples and not any(self.queues.by_model.values()):
                self._cond.wait()
            self._gather()
            if self._stop:
                return None
            heads = [(m, q.popleft()) for m, q in self.queues.by_model.items() if q]
            samples = list(self.queues.samples)
            self.queues.samples.clear()
            return heads, samples

    def _run(self) -> None:
        while (work := self._take()) is not None:
            named, samples = work
            heads = [j for _, j in named]
            for forward_only in (False, True):
                batch = [j for j in heads if j.fwdbwd is not None and j.fwdbwd.forward_only == forward_only]
                if batch:
                    self._fwdbwd(batch, backward=not forward_only)
            steps = [j for j in heads if j.optim is not None]
            if steps:
                self._optim(steps)
            for job in heads:
                if job.call is not None:
                    self._call(job)
            now = time.monotonic()
            for m, j in named:
                if j.fwdbwd is not None or j.optim is not None:
                    self._last_step[m] = now
            if samples:
                self._sample(samples)

    def _call(self, job: Job) -> None:
        try:
            self.store.set_result(job.rid, job.call())  # type: ignore[misc]
        except Exception as e:
            fail(self.store, job.rid, e)

    def _optim(self, jobs: list[Job]) -> None:
        """Every client's optim_step of this round in one fused AdamW (each client at most once per round)."""
        ok, requests = [], []
        for job in jobs:
            try:
                requests.append((self.trainer.client(job.optim[0]), job.optim[1]))  # type: ignore[index]
                ok.append(job)
            except Exception as e:
                fail(self.store, job.rid, e)
        try:
            metrics = adamw_steps(requests)
        except Exception as e:
            for job in ok:
                fail(self.store, job.rid, e)
            return
        self.optim_batch_sizes.append(len(ok))
        for job, m in zip(ok, metrics):
            self.store.set_result(job.rid, {"metrics": m})

    def _fwdbwd(self, jobs: list[Job], backward: bool) -> None:
        rows, ok = [], []
        for job in jobs:
            try:
                rows.extend(self.trainer.rows(len(ok), job.fwdbwd))  # type: ignore[arg-type]
                ok.append(job)
            except Exception as e:
                fail(self.store, job.rid, e)
        if not ok:
            return
        try:
            results = self.trainer.forward_backward(rows, len(ok), backward)
        except Exception as e:
            for job in ok:
                fail(self.store, job.rid, e)
            return
        self.num_batches += 1
        self.batch_sizes.append(len(ok))
        for job, (outputs, loss) in zip(ok, results):
            self.store.set_result(job.rid, encode_forward_backward(outputs, {"loss:sum": loss}))

    def _sample(self, jobs: list[Job]) -> None:
        try:
            results = self.sampler.run([j.sample for j in jobs])  # type: ignore[misc]
        except Exception as e:
            results = [e] * len(jobs)
        for job, result in zip(jobs, results):
            if isinstance(result, Exception):
                fail(self.store, job.rid, result)
            else:
                self.store.set_result(job.rid, result)
