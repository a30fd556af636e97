"""Disaggregated placement under ``torchrun`` (``--rollout-ranks R``): R ranks only generate, the other N − R train.

Ranks ``0 .. N−R−1`` train (rank 0 logs, evaluates and checkpoints, as always; with more than one, a data-parallel
group of their own — ``dist.new_group`` — that also carries the run's agreement and checkpoint barriers,
:mod:`spinwheel.parallel.run_group`). Ranks ``N−R .. N−1`` each play their share of every step's groups
(:func:`~spinwheel.rl.llm.rollout.dp_share` over the R rollout ranks) with an engine, the environments and the reward
of their own. Two process groups join trainer rank 0 with the rollout ranks
(``dist.new_group``; :class:`Placement`): on one the rollout ranks send each finished step batch to trainer rank 0
(:mod:`~spinwheel.rl.llm.rollouts.rollout_wire`); on the other trainer rank 0 broadcasts the weights after each update,
in
fixed-size buckets, and a receiver thread on every rollout rank publishes them to a
:class:`~spinwheel.rl.llm.rollouts.async_rollouts.WeightBox` that the rank's
:class:`~spinwheel.rl.llm.rollouts.async_rollouts.VersionedEngine` loads between two engine steps — the one-process
producer's
in-flight update, token versions and staleness bound (``--max-staleness K``, default 0), with the producer thread
replaced by a rank. At K = 0 a rollout rank plays step s with version s: the synchronous run, bit for bit, because
every episode is the same function of (seed, step, environment index, sample index) on any rank.

The run's start (its first step, its end and the weights, from the checkpoint on resume) reaches the rollout ranks
with the first broadcast; its end with a last header that says how it ended (0 done, 128 + N interrupted by signal
N, 1 failed), so every rank leaves together. Every wait across ranks is bounded by ``--timeout-s``: a rollout rank
that hangs or dies fails the trainer's step (the steps before are saved; rerunning resumes) with a one-line
:class:`~spinwheel.rl.llm.rollouts.rollout_wire.LinkError`, and a trainer that does the same stops the rollout ranks
(they
wait at most twice as long: :mod:`~spinwheel.rl.llm.rollouts.rollout_play`). Rollout ranks ignore Ctrl-C / SIGTERM
themselves: the trainer stops the run after its step, saves, and tells them.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spinwheel.envs import EnvError
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.parallel.run_group import set_run_group
from spinwheel.rl.llm.config import RLConfig
from spinwheel.rl.llm.rewards import RewardError
from spinwheel.rl.llm.rollouts.protocol import Rollout
from spinwheel.rl.llm.rollouts.rollout_wire import (
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
    rank 0 with the rollout ranks (weights), ``episodes`` the same ranks (step batches), ``trainer_group`` the
    trainer ranks (their data-parallel update, the run's agreement and checkpoints; ``None`` with one) and ``dims``
    their grid."""

    rank: int
    world: int
    rollout: int
    timeout_s: float
    device: torch.device
    link: Any = None
    episodes: Any = None
    trainer_group: Any = None
    dims: ParallelDims | None = None
    stopped: bool = False

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
        trainers = world - r
        if p.tp > 1 or p.pp > 1:
            raise ValueError("--rollout-ranks: the trainer ranks are data-parallel only for now; drop --tp/--pp")
        if p.dp not in (-1, trainers) or (p.hsdp and trainers % p.hsdp):
            raise ValueError(f"--dp {p.dp} / --hsdp {p.hsdp} must fit the {trainers} ranks --rollout-ranks {r} leaves")
        if config.lora_rank:
            raise ValueError("--rollout-ranks broadcasts full weights: drop --lora-rank (LoRA runs in one process)")
        if config.rollout_engine != "thread":
            raise ValueError("--rollout-ranks gives the engine ranks of its own: drop --rollout-engine process")
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        place = cls(rank, world, r, p.timeout_s, device)
        place.link = dist.new_group([0, *place.rollout_global_ranks])
        place.episodes = dist.new_group([0, *place.rollout_global_ranks])
        place.build_trainer_groups(p)
        return place

    def build_trainer_groups(self, p) -> None:
        """The trainers' group and grid (``dist.new_group``: every rank creates every group, rollout ranks too —
        theirs hold rank 0's place and are never used). Trainer ranks are global ranks ``0 .. T − 1``, so the
        grid's ranks are global ranks, and rank 0 stays the main rank."""
        trainers = self.trainers
        if trainers == 1:
            self.dims = ParallelDims()  # a world of its own: no collective among trainers
            return
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.trainer_group = dist.new_group(list(range(trainers)), timeout=timeout)
        shard = p.hsdp or trainers
        mine = self.rank if not self.is_rollout else 0
        self.dims = ParallelDims(trainers // shard, shard, 1, 1, trainers, mine, comm=Comm(self.timeout_s))
        self.dims.build_groups(self.timeout_s)
        if not self.is_rollout:
            set_run_group(self.trainer_group)  # the run's agreement and checkpoint barriers span the trainers

    @property
    def trainers_distributed(self) -> bool:
        return self.trainers > 1

    def trainer_dims(self) -> ParallelDims:
        assert self.dims is not None
        return self.dims

    def send(self, tensor: torch.Tensor, what: str) -> None:
        """Trainer rank 0: broadcast ``tensor`` to the rollout ranks (waits at most the timeout)."""
        work = dist.broadcast(tensor, src=0, group=self.link, async_op=True)
        wait(work, self.timeout_s, f"the rollout ranks did not take {what}")

    def stop(self, code: int) -> None:
        """Trainer rank 0, once: tell the rollout ranks the run ended with ``code`` (0 done, 128 + N interrupted by
        signal N, 1 failed); never raises (a rollout rank that is gone: the error in flight says why)."""
        if self.rank != 0 or self.stopped:
            return
        self.stopped = True
        try:
            self.send(torch.tensor([STOP, 0, 0, code, 0], dtype=torch.long, device=self.device), "the run's end")
        except LinkError:
            pass


@contextmanager
def placed(config: RLConfig, distributed: bool) -> Iterator[Placement | None]:
    """The run's :class:`Placement` with ``--rollout-ranks`` (else None). On the way out trainer rank 0 tells the
    rollout ranks how the run ended (also when it ended before its first step: a finished run, bad input), and the
    run's collectives span the whole world again."""
    if not config.rollout_ranks:
        yield None
        return
    place = Placement.create(config, distributed)
    try:
        yield place
    except BaseException as e:
        place.stop(e.exit_code if isinstance(e, Interrupted) else 1)
        raise
    finally:
        place.stop(0)
        set_run_group(None)


# ---- trainer rank 0 ----------------------------------------------------------------------------------------------


class RemoteRollouts:
    """The trainers' :class:`~spinwheel.rl.llm.rollouts.protocol.Rollouts`: trainer rank 0 receives the step batches
    from the
    rollout ranks and hands them to the other trainer ranks, and after each update broadcasts the new weights (every
    trainer rank first syncs its engine copy, ``sync_eval``: a collective where the layout shards the weights).
    Trainer rank 0 evaluates on its own engine (``llm``, over the trainer's weights) with ``source``'s held-out
    episodes; ``counts``: the rollout ranks' engine counts are step figures (``--max-staleness``)."""

    engine_copy_mb = 0.0

    def __init__(
        self, place: Placement, model: torch.nn.Module, first: int, end: int, sync_eval, context: int,
        source: Any = None, llm: Any = None, counts: bool = True,
    ) -> None:  # fmt: skip
        self.place, self.sync_eval, self.context = place, sync_eval, context
        self.source, self.llm, self.show_counts = source, llm, counts
        self.main = place.rank == 0
        self.counts = {"weight_swaps": 0.0, "kv_recomputed": 0.0}  # the rollout ranks' engines' so far
        self.broadcast: dict[str, float] = {}  # the last weight broadcast's seconds and MiB
        self.lost: LinkError | None = None  # a broadcast after an update that failed: the next take() raises it
        self.sync_eval()
        if self.main:  # the run's start: its first step, end and weights
            self._send_weights(first, end, model)

    def _send_weights(self, version: int, end: int, model: torch.nn.Module) -> None:
        place, start = self.place, time.perf_counter()
        header = torch.tensor([WEIGHTS, version, end, 0, self.context], dtype=torch.long, device=place.device)
        place.send(header, "the broadcast's header")
        tensors = weight_tensors(model.state_dict())
        sent = broadcast_weights(tensors, True, lambda b: place.send(b, f"the weights of version {version}"),
                                 device=place.device)  # fmt: skip
        self.broadcast = {"broadcast_s": time.perf_counter() - start, "broadcast_mb": sent / 2**20}

    def take(self, step: int) -> Rollout:
        """The step's episodes from every rollout rank, in rank order (= the one-process order of the groups), on
        every trainer rank; a failure on trainer rank 0 fails the step on every trainer rank."""
        start, outcome = time.perf_counter(), None
        if self.main:
            try:
                if self.lost is not None:
                    raise self.lost
                outcome = ("ok", self._receive(step))
            except StepFailed as e:
                outcome = ("error", e.cause)  # the cause alone crosses ranks (StepFailed does not pickle)
            except LinkError as e:  # a rollout rank hung or is gone
                outcome = ("error", e)
        if self.place.trainers_distributed:
            box = [outcome]
            dist.broadcast_object_list(box, src=0, group=self.place.trainer_group)
            outcome = box[0]
        assert outcome is not None
        if outcome[0] == "error":  # before any weight changed: the harness saves the steps before it
            raise StepFailed(outcome[1])
        rollout, self.counts = outcome[1]
        rollout.times["wait_rollout"] = time.perf_counter() - start
        return rollout

    def _receive(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """Trainer rank 0: (the step's rollout, the rollout ranks' engine counts so far)."""
        episodes, times = [], {"generate": 0.0, "score": 0.0, "wait_weights": 0.0}
        counts = dict.fromkeys(self.counts, 0.0)
        for src in self.place.rollout_global_ranks:
            what = f"rollout rank {src} sent no episodes for step {step}"
            kind, got, parts = recv_message(src, self.place.episodes, self.place.device, self.place.timeout_s, what)
            if kind == FAILED:
                raise StepFailed(RewardError(f"rollout rank {src}, step {got}: {error_text(parts)}"))
            if kind != EPISODES or got != step:
                raise RuntimeError(f"rollout rank {src} sent step {got} (kind {kind}) for step {step} (a bug)")
            mine, their_times = unpack_episodes(*parts)
            episodes += mine
            for k in counts:
                counts[k] += their_times.pop(k)
            for k, v in their_times.items():  # the slowest rollout rank's
                times[k] = max(times[k], v)
        failed = [e for e in episodes if e.failed]
        if 2 * len(failed) > len(episodes):
            raise StepFailed(EnvError(f"{len(failed)} of {len(episodes)} episodes failed: {failed[0].error}"))
        return Rollout(step, episodes, times), counts

    def figures(self) -> dict[str, float]:
        """The last weight broadcast's seconds and MiB, and (``counts``) the rollout ranks' weight swaps and KV
        recomputations so far."""
        return {**(self.counts if self.show_counts else {}), **self.broadcast}

    def evaluate(self, num: int) -> list | None:
        return self.source.held_out(self.llm, num) if self.main else None

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Every trainer rank: the engine copies take the new weights (``model``: trainer rank 0's); then trainer
        rank 0 broadcasts them to the rollout ranks as ``version``."""
        self.sync_eval()  # the trainers' own engines (evaluation), gathered where the layout shards the weights
        if self.main:
            try:
                self._send_weights(version, 0, model)
            except LinkError as e:  # the update is done: the next step fails, once the harness saved this one
                self.lost = e

    def close(self) -> None:
        pass  # the run's end reaches the rollout ranks from :func:`placed`
