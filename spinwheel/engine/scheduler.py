"""Iteration-level FCFS scheduling (Yu et al., "Orca", OSDI 2022) over a paged KV cache.

All three queues are kept in arrival order (``arrival_time``, also when ``add_request`` is given one). Every step
packs, under a token budget and a sequence cap:

1. the running groups, oldest first: one token per decoding sequence, the next chunk of a prompt still being
   prefilled. When the cache cannot hold their next tokens, the latest-arrived running group is preempted, all its
   sequences at once — by recompute (its blocks are freed and it goes back to its place in the waiting queue) or
   by swap (its blocks move to the CPU pool) — until the rest fit;
2. swapped groups, oldest first, brought back when their blocks plus the blocks of their next tokens fit (exactly
   counted: with every other group finished the pool always holds them, so a swapped group always comes back);
3. only when nothing is swapped out and nothing was preempted this step, waiting groups in arrival order, each
   prefilled whole or, with chunked prefill, in chunks under the remaining budget. A recomputed parallel-sampling
   or beam group computes the leading blocks its sequences share (the prompt at least) once and shares them again,
   so it needs no more blocks than when it was first admitted.

While a sequence decodes, the budget is ``max_num_batched_tokens_with_decodes`` (Agrawal et al., "Sarathi-Serve",
OSDI 2024: prompts admitted meanwhile are chunked so that no step stalls the running requests for long). A request
is rejected at once when even the whole pool could not hold it (``_never_fits``); every other request fits whenever
the pool is otherwise empty, so it finishes.

Every chunk is taken the same way (:meth:`Scheduler._plan` then :meth:`Scheduler._take`). The scheduler also creates
and drops the sequences sampling asks for — the ``n - 1`` forks of parallel sampling, the forks and ends of beam
search — so block tables change in one place. The scheduler decides; the block manager keeps the accounts; the model
runner executes the result.
"""

from __future__ import annotations

import itertools
from collections import deque

from spinwheel.engine.config import EngineConfig
from spinwheel.engine.forks import SamplingForks
from spinwheel.engine.kv.block_manager import AllocStatus, BlockManager
from spinwheel.engine.kv.reservation import ADMISSIONS
from spinwheel.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from spinwheel.engine.sequence import Sequence, SequenceGroup, SequenceStatus


class Scheduler(SamplingForks):
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.admission = ADMISSIONS[config.kv_allocation](block_manager)  # paged, or Orca's reservation
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_chunked_prefills = 0  # steps that computed part of a prompt, not all of it
        self._rejected: list[SequenceGroup] = []
        self._seq_ids = itertools.count()

    def next_seq_id(self) -> int:
        """A sequence id no other sequence of this scheduler has (block tables are keyed by it)."""
        return next(self._seq_ids)

    # ---- queue management ----
    def add(self, group: SequenceGroup) -> None:
        """Queue a request, or reject it at once when it could never fit."""
        reason = self._never_fits(group)
        if reason is not None:
            group.error = reason
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_ERROR
            self._rejected.append(group)
            return
        _insert_by_arrival(self.waiting, group)

    def _never_fits(self, group: SequenceGroup) -> str | None:
        prompt_len, max_tokens = len(group.prompt_token_ids), group.params.max_tokens
        if prompt_len == 0:
            return "the prompt is empty"
        if reason := self.admission.never_fits(group):
            return reason
        if group.width > self.config.max_num_seqs:
            return f"n={group.width} exceeds max_num_seqs={self.config.max_num_seqs}"
        if prompt_len + max_tokens > self.max_model_len:
            return (
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} exceeds "
                f"the model context of {self.max_model_len} tokens"
            )
        bm = self.block_manager
        prompt_blocks = bm.num_blocks_for(prompt_len)
        # Worst case: every sequence of the group writes its own copy of all blocks past the shared prompt.
        worst = prompt_blocks + group.width * (bm.num_blocks_for(prompt_len + max_tokens) - prompt_blocks + 1)
        if min(worst, group.width * bm.num_blocks_for(prompt_len + max_tokens)) > bm.gpu.num_blocks:
            return (
                f"the request needs up to {worst} KV blocks of {bm.block_size} tokens "
                f"(prompt {prompt_len} + max_tokens {max_tokens}, width {group.width}) but the whole KV pool "
                f"has {bm.gpu.num_blocks}"
            )
        return None

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is, freeing its blocks."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.seqs:
                        if not seq.status.is_finished:
                            seq.status = SequenceStatus.FINISHED_ABORTED
                        self.block_manager.free(seq.seq_id)
                    return group
        return None

    def free_finished(self) -> list[SequenceGroup]:
        """Release finished sequences' blocks; returns (and forgets) the groups that are done."""
        done = []
        for group in self.running:
            for seq in group.seqs:
                if seq.status.is_finished:
                    self.block_manager.free(seq.seq_id)
            if group.is_finished:
                done.append(group)
        if done:
            self.running = [g for g in self.running if not g.is_finished]
        return done

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def recompute_all(self) -> int:
        """Preempt every running and swapped group by recompute: their K/V are dropped and each is prefilled again
        (prompt and sampled tokens) when it is next admitted — after a weight change, so that no sequence goes on
        reading K/V the old weights computed. Returns the number of groups preempted."""
        groups = [*self.running, *self.swapped]
        self.running, self.swapped = [], deque()
        for group in groups:
            for s in group.unfinished_seqs():
                self.block_manager.free(s.seq_id)
                s.num_computed_tokens = 0
                s.status = SequenceStatus.WAITING
            group.shared_prefill = None
            _insert_by_arrival(self.waiting, group)
        self.num_preemptions += len(groups)
        return len(groups)

    # ---- the step ----
    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        out = SchedulerOutput(failed=self._rejected, block_tables=bm.block_tables)
        self._rejected = []
        budget = self._budget()
        num_seqs = 0

        # 1. running groups, oldest first; preempt from the newest end when blocks run out
        queue = deque(self.running)
        kept: list[SequenceGroup] = []
        while queue:
            group = queue.popleft()
            plan = self._plan(group.seqs_with(SequenceStatus.RUNNING), budget)
            if not plan or num_seqs + len(plan) > self.config.max_num_seqs:
                kept.append(group)  # nothing fits in this step's budget; it keeps its blocks
                continue
            need = [(s.seq_id, self._write_start(group, s), s.num_computed_tokens + n) for s, n in plan]
            while not bm.can_append_slots(need):
                victim = queue.pop() if queue else group
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                budget -= self._take(group, plan, out)
                num_seqs += len(plan)
                kept.append(group)
        self.running = kept

        # 2. swapped groups come back first (FCFS) when their blocks and their next tokens' blocks fit
        while self.swapped and out.num_preempted == 0:
            group = self.swapped[0]
            seqs = group.seqs_with(SequenceStatus.SWAPPED)
            ids, extents = [s.seq_id for s in seqs], [(self._write_start(group, s), s.num_tokens) for s in seqs]
            if (
                num_seqs + len(seqs) > self.config.max_num_seqs
                or budget < len(seqs)
                or not bm.can_swap_in(ids, extents)
            ):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += bm.swap_in(ids)
            for s in seqs:
                s.status = SequenceStatus.RUNNING
            budget -= self._take(group, self._plan(seqs, budget), out)
            num_seqs += len(seqs)
            _insert_by_arrival(self.running, group)

        # 3. new (or recompute-preempted) groups, only while nothing waits in the swap pool
        while self.waiting and not self.swapped and out.num_preempted == 0:
            group = self.waiting[0]
            seqs = group.seqs_with(SequenceStatus.WAITING)
            if num_seqs + len(seqs) > self.config.max_num_seqs:
                break
            shared = self._shared_prefix(seqs)
            cached = group.params.prompt_logprobs is None or group.forked  # scoring a prompt computes all of it
            status = self.admission.can_allocate(group, [s.token_ids for s in seqs], shared, cached)
            if status == AllocStatus.NEVER:  # cannot happen to a request _never_fits let in: fail it, never stall
                self.waiting.popleft()
                group.error = (
                    f"internal error: the request's {sum(s.num_tokens for s in seqs)} tokens do not fit "
                    f"in the KV pool of {bm.gpu.num_blocks} blocks"
                )
                for s in group.unfinished_seqs():
                    s.status = SequenceStatus.FINISHED_ERROR
                out.failed.append(group)
                continue
            if status == AllocStatus.LATER:
                break
            # without chunked prefill each sequence computes all its tokens in one step: the first one now, the others
            # of a recomputed group (sharing its leading blocks) as the budget allows
            if not self.config.enable_chunked_prefill and seqs[0].num_tokens > budget:
                break
            if budget < len(seqs):
                break
            self.waiting.popleft()
            self._allocate(group, seqs, shared, cached)
            budget -= self._take(group, self._plan(seqs, budget), out)
            num_seqs += len(seqs)
            _insert_by_arrival(self.running, group)
        return out

    def _budget(self) -> int:
        """Tokens this step may take: ``max_num_batched_tokens_with_decodes`` while a running sequence decodes (with
        chunked prefill: new prompts then come in chunks that never stall it for long), else all of the budget."""
        c, cap = self.config, self.config.max_num_batched_tokens_with_decodes
        running = (s for g in self.running for s in g.seqs_with(SequenceStatus.RUNNING))
        if cap is not None and c.enable_chunked_prefill and any(not s.is_prefill for s in running):
            return cap
        return c.max_num_batched_tokens

    def _shared_prefix(self, seqs: list[Sequence]) -> int:
        """Leading tokens (whole blocks, short of every sequence's last token) that all of ``seqs`` have in common:
        when a group forked earlier is recomputed, they are computed once and shared again."""
        if len(seqs) < 2:
            return 0
        first, limit = seqs[0].token_ids, min(s.num_tokens for s in seqs) - 1
        common = next((i for i in range(limit) if any(s.token_ids[i] != first[i] for s in seqs)), limit)
        return common // self.block_manager.block_size * self.block_manager.block_size

    def _allocate(self, group: SequenceGroup, seqs: list[Sequence], shared: int, cached: bool) -> None:
        """Block tables for a waiting group, all at once. After a recompute of a forked group the first sequence
        (the leader) recomputes the ``shared`` leading tokens for all of them and the others share its blocks.
        They never read those blocks before they are written: the leader is planned first and takes
        ``min(remaining, budget)``, so while it is short of ``shared`` the budget is spent (chunked prefill) —
        without chunked prefill it computes all its tokens in the step it is admitted — and in the step it gets
        there its K/V are written before any attention reads them."""
        bm = self.block_manager
        leader = seqs[0]
        leader.num_computed_tokens = bm.allocate(leader.seq_id, leader.token_ids, cached, group.params.lora)
        for s in seqs[1:]:
            if shared:
                bm.fork(leader.seq_id, s.seq_id, shared)
                bm.append_slots(s.seq_id, shared, s.num_tokens)  # fresh blocks only: nothing shared is written
                s.num_computed_tokens = shared
            else:
                s.num_computed_tokens = bm.allocate(s.seq_id, s.token_ids, namespace=group.params.lora)
        group.shared_prefill = (leader, shared) if shared else None
        for s in seqs:
            s.status = SequenceStatus.RUNNING
        self.admission.reserve(group, seqs)  # reserved allocation: the rest of prompt + max_tokens too

    def _plan(self, seqs: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute this step) for those of ``seqs`` that fit in ``budget``, in order."""
        plan = []
        for s in seqs:
            n = self._chunk(s, budget)
            if n > 0:
                plan.append((s, n))
                budget -= n
        return plan

    @staticmethod
    def _write_start(group: SequenceGroup, seq: Sequence) -> int:
        """Where copy-on-write starts for ``seq``'s next tokens: the leader of a shared prefill writes the shared
        blocks for everyone (no copy), everyone else from the first token it computes."""
        shared = group.shared_prefill
        if shared is not None and seq is shared[0]:
            return max(seq.num_computed_tokens, shared[1])
        return seq.num_computed_tokens

    def _take(self, group: SequenceGroup, plan: list[tuple[Sequence, int]], out: SchedulerOutput) -> int:
        """Schedule a plan: grow each block table to its chunk (copy-on-write copies go to ``out``) and record the
        blocks that will hold computed K/V. Returns the tokens taken from the budget."""
        taken = 0
        for s, n in plan:
            start = s.num_computed_tokens if group.shared_prefill is None else self._write_start(group, s)
            copies = self.block_manager.append_slots(s.seq_id, start, s.num_computed_tokens + n)
            if copies:
                out.blocks_to_copy += copies
            self._commit(s, n)
            out.scheduled.append(ScheduledSequence(s, group, n))
            taken += n
        return taken

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _commit(self, seq: Sequence, num_new: int) -> None:
        if seq.num_computed_tokens + num_new < seq.num_tokens:
            self.num_chunked_prefills += 1
        self.block_manager.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens + num_new)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Take ``group`` off the device: swap when configured and the CPU pool has room, else recompute."""
        seqs = group.seqs_with(SequenceStatus.RUNNING)
        ids = [s.seq_id for s in seqs]
        self.num_preemptions += 1
        out.num_preempted += 1
        if group in self.running:
            self.running.remove(group)
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(ids):
            out.blocks_to_swap_out += self.block_manager.swap_out(ids)
            self.num_swap_outs += 1
            for s in seqs:
                s.status = SequenceStatus.SWAPPED
            _insert_by_arrival(self.swapped, group)
            return
        for s in seqs:
            self.block_manager.free(s.seq_id)
            s.num_computed_tokens = 0
            s.status = SequenceStatus.WAITING
        group.shared_prefill = None  # re-admission computes the shared prefix again
        _insert_by_arrival(self.waiting, group)


def _insert_by_arrival(queue: deque[SequenceGroup] | list[SequenceGroup], group: SequenceGroup) -> None:
    """Every queue stays in arrival order (first come, first served; the latest arrival is evicted first), also
    for arrival times given to ``add_request`` and for groups coming back from preemption."""
    for i, other in enumerate(queue):
        if other.arrival_time > group.arrival_time:
            queue.insert(i, group)
            return
    queue.append(group)
