"""Disaggregated placement under ``torchrun`` (``--rollout-ranks R``): R ranks only generate, the other N − R train.

Ranks ``0 .. N−R−1`` train (rank 0 logs, evaluates and checkpoints, as always), ranks ``N−R .. N−1`` each play their
share of every step's groups (:func:`~spinwheel.rl.llm.rollout.dp_share` over the R rollout ranks) with an engine,
the environments and the reward of their own. Two process groups join trainer rank 0 with the rollout ranks
(``dist.new_group``; :class:`Placement`): on one the rollout ranks send each finished step batch to trainer rank 0
(:mod:`~spinwheel.rl.llm.rollout_wire`); on the other trainer rank 0 broadcasts the weights after each update, in
fixed-size buckets, and a receiver thread on every rollout rank publishes them to a
:class:`~spinwheel.rl.llm.async_rollouts.WeightBox` that the rank's
:class:`~spinwheel.rl.llm.async_rollouts.VersionedEngine` loads between two engine steps — the one-process producer's
in-flight update, token versions and staleness bound (``--max-staleness K``, default 0), with the producer thread
replaced by a rank. At K = 0 a rollout rank plays step s with version s: the synchronous run, bit for bit, because
every episode is the same function of (seed, step, environment index, sample index) on any rank.

The run's start (its first step, its end and the weights, from the checkpoint on resume) reaches the rollout ranks
with the first broadcast; its end with a last header that says how it ended (0 done, 128 + N interrupted by signal
N, 1 failed), so every rank leaves together. Every wait across ranks is bounded by ``--timeout-s``: a rollout rank
that hangs or dies stops the trainer with a one-line :class:`~spinwheel.rl.llm.rollout_wire.LinkError`, and a
trainer that does the same stops the rollout ranks. Rollout ranks ignore Ctrl-C / SIGTERM themselves: the trainer
stops the run after its step, saves, and tells them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.llm.async_rollouts import Rollout
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.rollout_wire import (
    EPISODES,
    FAILED,
    LinkError,
    broadcast_weights,
    error_text,
    recv_message,
    unpack_episodes,
    wait,
    weight_tensors,
)
from spinwheel.train.interrupt import Interrupted
from spinwheel.train.run import StepFailed

WEIGHTS, STOP = 1, 2  # kinds of a broadcast header: [kind, version, end step, exit code, engine context]


@dataclass
class Placement:
    """Who does what: ``rank`` of ``world`` processes, the last ``rollout`` of them generate; ``link`` is trainer
    rank 0 with the rollout ranks (weights), ``episodes`` the same ranks (step batches)."""

    rank: int
    world: int
    rollout: int
    timeout_s: float
    device: torch.device
    link: Any = None
    episodes: Any = None

    @property
    def trainers(self) -> int:
        return self.world - self.rollout

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainers

    @property
    def rollout_index(self) -> int:
        return self.rank - self.trainers

    @property
    def rollout_global_ranks(self) -> list[int]:
        return list(range(self.trainers, self.world))

    @classmethod
    def create(cls, config: RLConfig, distributed: bool) -> Placement:
        """Check the layout (one-line errors) and build the groups (every rank calls this, in the same order)."""
        r, p = config.rollout_ranks, config.parallel
        assert r is not None
        if not distributed:
            raise ValueError(
                f"--rollout-ranks {r} places ranks on generation: launch the run with "
                f"`spinwheel launch --nproc-per-node N {config.algo} ...` (N > {r}), or drop --rollout-ranks"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        if r >= world:
            raise ValueError(
                f"--rollout-ranks {r} leaves no trainer rank in a world of {world} processes: use at most {world - 1}"
            )
        if p.tp > 1 or p.pp > 1 or world - r > 1:
            raise ValueError(
                f"--rollout-ranks trains on one rank for now ({world - r} trainer ranks here, tp={p.tp}, pp={p.pp}): "
                f"launch {r + 1} processes for --rollout-ranks {r}"
            )
        if p.dp not in (-1, world - r):
            raise ValueError(f"--dp {p.dp} must be the {world - r} ranks --rollout-ranks {r} leaves to train")
        if config.lora_rank:
            raise ValueError("--rollout-ranks broadcasts full weights: drop --lora-rank (LoRA runs in one process)")
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        place = cls(rank, world, r, p.timeout_s, device)
        members = [0, *place.rollout_global_ranks]
        place.link = dist.new_group(members)
        place.episodes = dist.new_group(members)
        return place

    def trainer_dims(self) -> ParallelDims:
        return ParallelDims()  # one trainer rank: a world of its own (no collective among trainers)


# ---- trainer rank 0 ----------------------------------------------------------------------------------------------


class RemoteRollouts:
    """The trainer's side (what :class:`~spinwheel.rl.llm.async_rollouts.SyncRollouts` is in one process): step
    batches received from the rollout ranks, new weights broadcast to them."""

    def __init__(self, place: Placement, model: torch.nn.Module, first: int, end: int, sync_eval, context: int) -> None:
        self.place, self.sync_eval, self.context = place, sync_eval, context
        self.engine = SimpleNamespace(num_swaps=0)  # the rollout ranks' swaps (staleness figures)
        self.broadcast: dict[str, float] = {}  # the last weight broadcast's seconds and MiB
        self.closed = False
        self._broadcast(WEIGHTS, first, end, model)  # the run's start: its first step, end and weights

    def _broadcast(self, kind: int, version: int, end: int, model: torch.nn.Module | None, code: int = 0) -> None:
        place = self.place
        header = torch.tensor([kind, version, end, code, self.context], dtype=torch.long, device=place.device)
        self._send(header, "the broadcast's header")
        if model is None:
            return
        start = time.perf_counter()
        tensors = weight_tensors(model.state_dict())
        sent = broadcast_weights(tensors, True, lambda b: self._send(b, f"the weights of version {version}"),
                                 device=place.device)  # fmt: skip
        self.broadcast = {"broadcast_s": time.perf_counter() - start, "broadcast_mb": sent / 2**20}

    def _send(self, tensor: torch.Tensor, what: str) -> None:
        work = dist.broadcast(tensor, src=0, group=self.place.link, async_op=True)
        wait(work, self.place.timeout_s, f"the rollout ranks did not take {what}")

    def take(self, step: int) -> Rollout:
        """The step's episodes from every rollout rank, in rank order (= the one-process order of the groups)."""
        start, episodes, times = time.perf_counter(), [], {"generate": 0.0, "score": 0.0, "wait_weights": 0.0}
        swaps = 0.0
        for src in self.place.rollout_global_ranks:
            what = f"rollout rank {src} sent no episodes for step {step}"
            kind, got, parts = recv_message(src, self.place.episodes, self.place.device, self.place.timeout_s, what)
            if kind == FAILED:
                raise StepFailed(RuntimeError(f"rollout rank {src}, step {got}: {error_text(parts)}"))
            if kind != EPISODES or got != step:
                raise RuntimeError(f"rollout rank {src} sent step {got} (kind {kind}) for step {step} (a bug)")
            mine, their_times = unpack_episodes(*parts)
            episodes += mine
            swaps += their_times.pop("weight_swaps")
            for k, v in their_times.items():  # the slowest rollout rank's
                times[k] = max(times[k], v)
        self.engine.num_swaps = swaps
        failed = [e for e in episodes if e.failed]
        if 2 * len(failed) > len(episodes):
            raise StepFailed(RuntimeError(f"{len(failed)} of {len(episodes)} episodes failed: {failed[0].error}"))
        times["wait_rollout"] = time.perf_counter() - start
        return Rollout(step, episodes, times)

    def figures(self) -> dict[str, float]:
        """The rollout ranks' weight swaps so far (with ``--max-staleness``: beside the staleness figures)."""
        return {"weight_swaps": float(self.engine.num_swaps)}

    def publish(self, version: int, model: torch.nn.Module) -> None:
        self._broadcast(WEIGHTS, version, 0, model)
        self.sync_eval()  # the trainer's own engine (evaluation) on the new weights

    def close(self) -> None:
        """Tell the rollout ranks the run ended, and how (from the exception in flight, if any); never raises."""
        if self.closed:
            return
        self.closed = True
        error = sys.exc_info()[1]
        code = 0 if error is None else (error.exit_code if isinstance(error, Interrupted) else 1)
        try:
            self._broadcast(STOP, 0, 0, None, code)
        except LinkError:
            pass  # a rollout rank that is gone: the error in flight says why


def trainer_rollouts(job) -> RemoteRollouts:
    """The :class:`RemoteRollouts` of an :class:`~spinwheel.rl.llm.loop.RLJob` on trainer rank 0 (its engine
    evaluates)."""
    from spinwheel.engine import LLM

    model, run, options = job.learner.engine_model, job.run, job.engine_options
    job.llm = job.eval_llm = LLM(model, job.tokenizer, **options)
    return RemoteRollouts(job.placement, model, run.start_step, run.end_step, job.sync_engine, options["max_model_len"])


def rollout_figures(rollouts) -> dict[str, float]:
    """The last weight broadcast's seconds and MiB (nothing for the one-process rollouts)."""
    return dict(getattr(rollouts, "broadcast", {}))
