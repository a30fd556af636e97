"""The engine loop a server drives: ``add_request`` / ``abort`` / ``step`` -> incremental :class:`RequestOutput`.

``step`` is schedule (:mod:`~spinwheel.engine.scheduler`) -> execute (the engine's
:class:`~spinwheel.engine.executor.Executor`: block moves and one forward, on one device or over its ranks) -> process
the outputs: sample, fork parallel samples, advance beams, check stops (:mod:`~spinwheel.engine.output_processor`),
free finished sequences and build the outputs.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

import torch

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.executor import ExecutorFactory
from spinwheel.engine.executor_factory import make_executor  # one device, tensor- or pipeline-parallel, or both
from spinwheel.engine.isolation import RequestFailures, failed_output, sample_isolated
from spinwheel.engine.kernels.denormals import flush_denormal
from spinwheel.engine.kv.block_manager import BlockManager
from spinwheel.engine.model_runner import StepLogits
from spinwheel.engine.output_processor import OutputProcessor
from spinwheel.engine.outputs import EngineStats, RequestOutput, StepInfo
from spinwheel.engine.sampling.beam_search import beam_step
from spinwheel.engine.sampling.sampler import Sampler, SampleRow
from spinwheel.engine.sampling_params import SamplingParams
from spinwheel.engine.scheduler import Scheduler
from spinwheel.engine.scheduler_output import SchedulerOutput
from spinwheel.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from spinwheel.models.tokenizer import Tokenizer
from spinwheel.models.transformer import Transformer
from spinwheel.threads import fit_threads

logger = logging.getLogger(__name__)


class LLMEngine:
    """Requests in, one step at a time (schedule -> execute on the :class:`~spinwheel.engine.executor.Executor` ->
    process the outputs), their outputs back: what ``LLM``, the server's engine process and the RL rollouts drive."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        *,
        # builds what runs the model (default: the executor config asks for); the RL loop's --engine-tp passes its own
        executor: ExecutorFactory = make_executor,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        self.executor = executor(model, config, self.max_model_len)
        self.runner = self.executor.runner  # this process's part of the model (tp > 1: rank 0's shard)
        self.model = model = self.runner.model
        self.loras = self.runner.loras  # LoRA adapters served by name, unmerged: loras.add(name, adapter_dir)
        pool_tokens = self.runner.num_blocks * config.block_size
        if config.max_model_len is None and self.max_model_len > pool_tokens:  # a context no request could use
            logger.warning(
                "max_model_len capped to %d tokens, what the KV pool holds (%d blocks of %d), from the model's "
                "max_position_embeddings %d; give more KV memory (kv_cache_memory_mb) for longer contexts",
                pool_tokens,
                self.runner.num_blocks,
                config.block_size,
                self.max_model_len,
            )
            self.max_model_len = pool_tokens
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            self.runner.num_cpu_blocks,
            config.block_size,
            config.enable_prefix_caching,
            reuse_first=self.runner.lazy_kv,  # a CPU pool's memory is committed as its blocks are first used
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.sampler = Sampler(config.seed)
        eos = model.config.eos_token_id
        eos_ids: set[int] = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer is not None and tokenizer.eos_id is not None:
            eos_ids = {tokenizer.eos_id}
        self.output_processor = OutputProcessor(tokenizer, eos_ids, self.max_model_len)
        self._groups: dict[str, SequenceGroup] = {}
        self._aborted: list[SequenceGroup] = []
        self._failures = RequestFailures()  # requests that failed in the step being processed
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens generated) per step
        self.last_step: StepInfo | None = None
        # monotonic time of the last token produced or request finished (rejections and aborts included); reset
        # when work arrives at an idle engine, so a health check measures a stall from then
        self.last_progress_time = time.monotonic()

    @classmethod
    def from_pretrained(
        cls, path_or_preset: str | os.PathLike, config: EngineConfig | None = None, tokenizer: Tokenizer | None = None
    ) -> LLMEngine:
        """Load a checkpoint directory or preset on ``config.device`` (default: cuda when available) with its
        tokenizer (unless one is given)."""
        from spinwheel.models import load_model, load_tokenizer

        config = config or EngineConfig()
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(path_or_preset, dtype=config.dtype, device=device)
        return cls(model, tokenizer or load_tokenizer(path_or_preset), config)

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a sequence (unless ``ignore_eos``)."""
        return self.output_processor.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: set[int]) -> None:
        self.output_processor.eos_ids = set(ids)

    # ---- requests ----
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (text or token ids). One that can never fit finishes with an error on the next step."""
        params = params or SamplingParams()
        self.loras.slot(params.lora)  # an adapter the engine does not serve is a ValueError
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or give the engine a tokenizer")
            text, tokens = prompt, self.tokenizer.encode(prompt)
        else:
            text, tokens = None, [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary (0..{vocab - 1})")
        seq = Sequence(self.scheduler.next_seq_id(), tokens)
        group = SequenceGroup(request_id, [seq], params, prompt=text)
        if arrival_time is not None:
            group.arrival_time = arrival_time
        if not self._groups:
            self.last_progress_time = time.monotonic()
        self._groups[request_id] = group
        if bad:
            group.error = f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})"
            seq.status = SequenceStatus.FINISHED_ERROR
            self._aborted.append(group)
            return
        self.scheduler.add(group)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; its final output (finish_reason "abort") comes with the next step."""
        group = self.scheduler.abort(request_id)
        if group is None:
            return False
        group.finish_time = time.monotonic()
        self._aborted.append(group)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def seconds_without_progress(self, now: float | None = None) -> float:
        """How long the engine has had unfinished work without producing a token or finishing a request (0 when
        idle): what a health check compares with its limit. It only reads two attributes, so a server may call it
        from another thread than the one stepping the engine."""
        if not self._groups:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self.last_progress_time)

    # ---- the step ----
    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Run one iteration. Returns outputs of the requests that progressed (all of them with ``stream``) or
        finished."""
        outputs = []
        for group in self.step_groups(stream):
            try:
                outputs.append(self.output_processor.request_output(group))
            except Exception as e:  # noqa: BLE001 - that request alone fails (its blocks freed)
                outputs.append(failed_output(group, e))
                self.scheduler.abort(group.request_id)
                self._groups.pop(group.request_id, None)
                self.output_processor.forget(group)
        return outputs

    def step_groups(self, stream: bool = True) -> list[SequenceGroup]:
        """``step`` for a caller that builds its own outputs from the groups (the engine process sends only what
        is new in each); the finished ones are already forgotten here."""
        fit_threads()  # fewer threads while other processes hold cores (spinwheel.threads)
        with flush_denormal(self.config.flush_denormal):
            out = self.scheduler.schedule()
            step = self.executor.execute_model(out)
            touched = self._process(out, step) if step is not None else {}
            return self._outputs(out, touched, stream)

    def stop_sample(self, request_id: str, index: int, stop_reason: str) -> None:
        """Finish decoding sample ``index`` of a running request (a stop string its caller found; the next step
        frees its blocks). A sample preempted or recomputing runs on: the caller ignores it or aborts the request."""
        group = self._groups.get(request_id)
        ok = group is not None and not group.params.use_beam_search and group in self.scheduler.running
        for s in group.seqs_with(SequenceStatus.RUNNING) if ok else []:  # type: ignore[union-attr]
            if s.index == index and not s.is_prefill:
                s.status, s.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_reason

    def _process(self, out: SchedulerOutput, step: StepLogits) -> dict[str, SequenceGroup]:
        """Account the computed tokens, sample the rows that completed (forking parallel samples on their first
        token), advance beam search; returns the groups that got a new token. An exception in one request's part
        fails that request only (:mod:`~spinwheel.engine.isolation`)."""
        touched: dict[str, SequenceGroup] = {}
        rows: list[SampleRow] = []
        owners: list[SequenceGroup] = []  # the group of each sample row
        row_index: list[int] = []  # logits row of each sample row: n > 1 forks share one
        beam_groups: dict[str, SequenceGroup] = {}
        eos_ids, failures = self.eos_ids, self._failures
        for s in out.scheduled:
            seq, group = s.seq, s.group
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens += min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            if seq.seq_id in step.prompt_rows and group not in failures:
                with failures.guard(group, "prompt logprobs"):
                    self.output_processor.record_prompt_logprobs(group, seq, step, s.num_new_tokens)
            seq.num_computed_tokens += s.num_new_tokens
            if not s.completes or group in failures:
                continue
            touched[group.request_id] = group
            logits_row = step.sample_rows[seq.seq_id]
            if group.params.use_beam_search:
                seq.pending_logprobs = torch.log_softmax(step.logits[logits_row], dim=-1)
                beam_groups[group.request_id] = group
                continue
            with failures.guard(group, "sampling"):
                stop_ids = sorted(eos_ids | set(group.params.stop_token_ids))
                for t in [seq] if group.forked else self.scheduler.fork_samples(group, seq):
                    rows.append(SampleRow(t, group.params, stop_ids))
                    owners.append(group)
                    row_index.append(logits_row)
        sampled = sample_isolated(self.sampler, step.logits, rows, owners, row_index, failures) if rows else []
        for i, token, lp, top in sampled:
            rows[i].seq.append_token(token, lp, top)
            with failures.guard(owners[i], "the stop check"):
                self.output_processor.check_stop(rows[i].seq, rows[i].params)
        self.num_generated_tokens += len(sampled)
        num_beams = 0
        for group in beam_groups.values():
            with failures.guard(group, "beam search"):
                num_beams += self._beam_step(group)
        now = time.monotonic()
        self._recent.append((now, len(sampled) + num_beams))
        for group in touched.values():
            group.first_token_time = group.first_token_time or now
        return touched

    def _beam_step(self, group: SequenceGroup) -> int:
        """One beam-search step once every running beam has its next-token distribution (after a recompute they
        arrive over several steps); returns how many beams the group holds now (the step's throughput counts
        them)."""
        beams = group.seqs_with(SequenceStatus.RUNNING)
        if any(b.pending_logprobs is None for b in beams):
            return len(group.seqs)
        logprobs = torch.stack([b.pending_logprobs for b in beams])  # type: ignore[misc]  # (B, V)
        for b in beams:
            b.pending_logprobs = None
        choices, group.finished_beams, group.beam_improvable, done = beam_step(
            logprobs,
            [b.cumulative_logprob for b in beams],
            [b.output_token_ids for b in beams],
            beams[0].num_output_tokens,
            group.params,
            self.eos_ids,
            group.finished_beams,
            group.beam_improvable,
        )
        self.num_generated_tokens += len(beams)
        self.scheduler.continue_beams(group, beams, [] if done else choices)
        return len(group.seqs)

    def _outputs(self, out: SchedulerOutput, touched: dict[str, SequenceGroup], stream: bool) -> list[SequenceGroup]:
        """Free finished sequences; the groups touched this step (all of them with ``stream``) and those that
        finished, failed or were aborted."""
        self.last_step = StepInfo(out.num_decode_tokens, out.num_tokens - out.num_decode_tokens, out.num_preempted)
        for group in self._failures.take():  # failed in this step: their blocks are freed now
            self.scheduler.abort(group.request_id)
            self._aborted.append(group)
        for group in out.failed + self._aborted + self.scheduler.free_finished():
            touched[group.request_id] = group
        self._aborted = []
        now = time.monotonic()
        if touched:
            self.last_progress_time = now
        for group in touched.values():
            if group.is_finished:
                group.finish_time = group.finish_time or now
                self._groups.pop(group.request_id, None)
        return [g for g in touched.values() if stream or g.is_finished]

    def stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        rate = 0.0
        if len(self._recent) >= 2:
            span = self._recent[-1][0] - self._recent[0][0]
            rate = sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0
        return EngineStats(
            len(sch.running),
            len(sch.waiting),
            len(sch.swapped),
            bm.num_used_blocks / bm.gpu.num_blocks,
            bm.num_free_blocks,
            bm.gpu.num_blocks,
            sch.num_preemptions,
            bm.prefix_cache_hit_rate,
            self.num_prompt_tokens,
            self.num_generated_tokens,
            rate,
        )

    def kv_slot_usage(self) -> tuple[int, int]:
        """(slots in device blocks held by sequences, slots holding a computed token), counting shared blocks once."""
        bs = self.config.block_size
        filled: dict[int, int] = {}
        for group in self.scheduler.running:
            for s in group.seqs_with(SequenceStatus.RUNNING):
                for i, b in enumerate(self.block_manager.block_tables.get(s.seq_id, [])):
                    f = min(bs, max(0, s.num_computed_tokens - i * bs))
                    if f > filled.get(b, 0):
                        filled[b] = f
        return self.block_manager.num_used_blocks * bs, sum(filled.values())

    # ---- weights ----
    def update_weights(self, model_or_state_dict: Transformer | dict[str, torch.Tensor]) -> None:
        """Load new weights on every rank (from a model or a state dict, checked whole first: a bad tensor is one line
        and nothing changes) and drop the prefix cache, whose K/V were computed with the old ones. Call between
        generations: running requests would mix old and new K/V."""
        self.executor.update_weights(model_or_state_dict)
        self.scheduler.reset_prefix_cache()

    def add_lora(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT adapter in ``path`` as ``name``: requests with ``SamplingParams(lora=name)`` run through it,
        unmerged, in the same batches as the base's and other adapters' (:mod:`~spinwheel.engine.multi_lora`)."""
        self.executor.add_lora(name, path)
