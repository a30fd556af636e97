"""The pipeline-parallel engine: P micro-batches in flight through P stages (Orca's inter-layer parallelism).

An engine iteration needs the tokens its previous one sampled, so one batch alone would leave all stages but one
idle. :class:`PPEngine` splits the requests into P disjoint micro-batches (vLLM's *virtual engines*): each has its
own scheduler and block manager over its own slice of the KV pool (blocks ``[b·n, (b+1)·n)`` of every stage's pool,
so its block ids are global and the stages need no translation), and a new request joins the one with the fewest
requests. A step launches every micro-batch that is not in flight (schedule, then stage 0's layers; the stages after
it work on earlier ones meanwhile), then takes the logits of the oldest one in flight and processes them exactly as
:class:`~spinwheel.engine.llm_engine.LLMEngine` does (the sampler runs here, on the driver): while the driver samples
micro-batch b and runs stage 0 of its next iteration, the last stage computes micro-batch b'.

Everything the engine does per micro-batch is the one-device code: chunked prefill, prefix caching (within a
micro-batch), parallel sampling and beams with copy-on-write, swap and recompute preemption; the block moves of an
iteration travel with it to every stage. An abort or a stop string for a request whose iteration is in flight is
applied once that iteration is back. LoRA adapters (mixed in a batch, added at any time) and ``update_weights``:
each stage holds its own layers' part, shipped through its pipe in iteration order
(:mod:`~spinwheel.engine.parallel.pp_lora`).
With ``tensor_parallel_size`` T > 1 every stage is a T-rank tensor-parallel group
(:mod:`~spinwheel.engine.parallel.tp_pp`).
Each micro-batch owns 1/P of the pool, so a request must fit in that.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections import deque
from typing import Any

import torch

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.executor import PipelinedExecutor
from spinwheel.engine.kernels.denormals import flush_denormal
from spinwheel.engine.kv.block_manager import BlockManager
from spinwheel.engine.kv.block_pool import BlockPool
from spinwheel.engine.llm_engine import LLMEngine
from spinwheel.engine.outputs import EngineStats
from spinwheel.engine.parallel.pp_stage import check_checkpoint_pp_degree
from spinwheel.engine.parallel.tp_worker import check_checkpoint_tp_degree
from spinwheel.engine.scheduler import Scheduler
from spinwheel.engine.scheduler_output import SchedulerOutput
from spinwheel.engine.sequence import SequenceGroup, SequenceStatus
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.threads import fit_threads

logger = logging.getLogger(__name__)


class _PoolSlice(BlockPool):
    """The blocks ``[start, start + n)`` of the stages' pool: one micro-batch's (ids below ``start`` exist, unused)."""

    def __init__(self, start: int, n: int) -> None:
        super().__init__(start + n)
        self.num_blocks = n
        self._free = deque(range(start, start + n))


class _MicroBatch:
    """One virtual engine: its scheduler and block manager, whether an iteration of it is in flight, and the aborts
    and stops that wait for that iteration."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.block_manager = scheduler, scheduler.block_manager
        self.busy = False
        self.deferred: list[tuple] = []

    def holds(self, request_id: str) -> bool:
        s = self.scheduler
        return any(g.request_id == request_id for q in (s.waiting, s.running, s.swapped) for g in q)

    @property
    def load(self) -> int:
        s = self.scheduler
        return len(s.waiting) + len(s.running) + len(s.swapped)


class PPEngine(LLMEngine):
    """:class:`LLMEngine` over a P-stage pipeline with P micro-batches in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """:class:`LLMEngine`'s arguments; its executor a PipelinedExecutor (stage 0 here, the others spawned)."""
        super().__init__(*args, **kwargs)
        config, pp = self.config, self.config.pipeline_parallel_size
        n, m, bs = self.runner.num_blocks // pp, self.runner.num_cpu_blocks // pp, config.block_size
        if config.max_model_len is None and self.max_model_len > n * bs:
            logger.warning("max_model_len capped to %d tokens, what one micro-batch's KV pool holds", n * bs)
            self.max_model_len = self.output_processor.max_model_len = n * bs
        seq_ids = itertools.count()  # sequence ids unique across micro-batches (the sampler keys rows by them)
        self.micro: list[_MicroBatch] = []
        for b in range(pp):
            bm = BlockManager(n, m, bs, config.enable_prefix_caching)
            bm.gpu, bm.cpu = _PoolSlice(b * n, n), _PoolSlice(b * m, m)
            scheduler = Scheduler(config, bm, self.max_model_len)
            scheduler._seq_ids = seq_ids
            self.micro.append(_MicroBatch(scheduler))
        self._in_flight: deque[tuple[_MicroBatch, SchedulerOutput]] = deque()
        self.executor: PipelinedExecutor
        self._use(self.micro[0])

    @classmethod
    def from_pretrained(
        cls, path_or_preset: str | os.PathLike, config: EngineConfig | None = None, tokenizer: Tokenizer | None = None
    ) -> PPEngine:
        """:meth:`LLMEngine.from_pretrained`, the PP (and TP) degree checked on the checkpoint's config first."""
        config = config or EngineConfig()
        check_checkpoint_pp_degree(path_or_preset, config.pipeline_parallel_size)
        check_checkpoint_tp_degree(path_or_preset, config.tensor_parallel_size)
        return super().from_pretrained(path_or_preset, config, tokenizer)  # type: ignore[return-value]

    def _use(self, micro: _MicroBatch) -> None:
        self.scheduler, self.block_manager = micro.scheduler, micro.block_manager

    # ---- requests ----
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params=None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request in the micro-batch with the fewest requests."""
        self._use(min(self.micro, key=lambda mb: mb.load))
        super().add_request(request_id, prompt, params, arrival_time)

    def abort(self, request_id: str) -> bool:
        for micro in self.micro:
            if micro.holds(request_id):
                if micro.busy:  # its blocks are being computed on: abort once the iteration is back
                    micro.deferred.append(("abort", request_id))
                    return True
                self._use(micro)
                return super().abort(request_id)
        return False

    def stop_sample(self, request_id: str, index: int, stop_reason: str) -> None:
        for micro in self.micro:
            if micro.holds(request_id):
                if micro.busy:
                    micro.deferred.append(("stop", request_id, index, stop_reason))
                else:
                    self._use(micro)
                    super().stop_sample(request_id, index, stop_reason)

    # ---- the step ----
    def step_groups(self, stream: bool = True) -> list[SequenceGroup]:
        """Launch every micro-batch not in flight, then process the oldest one in flight."""
        fit_threads()
        with flush_denormal(self.config.flush_denormal):
            groups = self._launch(stream)
            if not self._in_flight:
                return groups
            micro, out = self._in_flight.popleft()
            step = self.executor.collect()
            micro.busy = False
            self._use(micro)
            touched = self._process(out, step)
            groups += self._outputs(out, touched, stream)
            deferred, micro.deferred = micro.deferred, []
            for command in deferred:
                if command[0] == "abort":
                    super().abort(command[1])
                else:
                    super().stop_sample(*command[1:])
            return groups

    def _launch(self, stream: bool) -> list[SequenceGroup]:
        groups: list[SequenceGroup] = []
        for micro in self.micro:
            if micro.busy:
                continue
            self._use(micro)
            out = self.scheduler.schedule()
            if self.executor.launch(out):
                micro.busy = True
                self._in_flight.append((micro, out))
            else:  # nothing to run (or only blocks moved): its rejected requests and finished ones still end
                groups += self._outputs(out, {}, stream)
        return groups

    # ---- what is not per micro-batch (read-only: a server may call these from another thread) ----
    def stats(self) -> EngineStats:
        one = super().stats()  # the engine-wide token counts and rate
        bms, schs = [mb.block_manager for mb in self.micro], [mb.scheduler for mb in self.micro]
        blocks, free = sum(bm.gpu.num_blocks for bm in bms), sum(bm.num_free_blocks for bm in bms)
        return dataclasses.replace(
            one,
            num_running=sum(len(s.running) for s in schs),
            num_waiting=sum(len(s.waiting) for s in schs),
            num_swapped=sum(len(s.swapped) for s in schs),
            kv_usage=(blocks - free) / blocks,
            num_free_blocks=free,
            num_blocks=blocks,
            num_preemptions=sum(s.num_preemptions for s in schs),
            prefix_cache_hit_rate=sum(bm.num_prefix_hit_tokens for bm in bms)
            / max(1, sum(bm.num_prefix_queried_tokens for bm in bms)),
        )

    def kv_slot_usage(self) -> tuple[int, int]:
        """(slots in device blocks held by sequences, slots holding a computed token), over every micro-batch."""
        bs, held, filled = self.config.block_size, 0, 0
        for micro in self.micro:
            full: dict[int, int] = {}
            for group in micro.scheduler.running:
                for s in group.seqs_with(SequenceStatus.RUNNING):
                    for i, b in enumerate(micro.block_manager.block_tables.get(s.seq_id, [])):
                        full[b] = max(full.get(b, 0), min(bs, max(0, s.num_computed_tokens - i * bs)))
            held, filled = held + micro.block_manager.num_used_blocks * bs, filled + sum(full.values())
        return held, filled

    def update_weights(self, model_or_state_dict: Transformer | dict[str, torch.Tensor]) -> None:
        """:meth:`LLMEngine.update_weights` over the stages: the names and shapes checked against the whole model
        first, then stage 0's part loaded here and every other stage's sent through its pipe, behind the iterations
        in flight (which finish on the old weights: :mod:`~spinwheel.engine.parallel.pp_lora`). Every micro-batch's
        prefix
        cache is dropped; as on one device, call it between generations (running requests would mix old and new
        K/V)."""
        self.executor.update_weights(model_or_state_dict)
        for micro in self.micro:
            micro.scheduler.reset_prefix_cache()


def engine_class(config: EngineConfig) -> type[LLMEngine]:
    """The engine a config asks for: :class:`PPEngine` with ``pipeline_parallel_size`` > 1, else LLMEngine."""
    return PPEngine if config.pipeline_parallel_size > 1 else LLMEngine
