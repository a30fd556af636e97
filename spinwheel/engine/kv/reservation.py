"""How the scheduler admits a request into the KV pool: paged (PagedAttention) or reserved up front (Orca's baseline).

Orca (Yu et al., OSDI 2022) has no paging: when it admits a request it reserves KV slots for the longest sequence
the request may become — prompt + ``max_tokens`` — and keeps them until the request finishes (Kwon et al., SOSP
2023, §3 and Fig. 3: the reserved future slots and internal fragmentation are the waste PagedAttention removes;
§6.1: their "Orca (Oracle)" is this with ``max_tokens`` equal to the real output length, the most favourable case).
Here the reservation is made of the pool's blocks: up to b − 1 slots more than an exact reservation, but none of the
external fragmentation contiguous chunks would add — so what paging gains over it is, if anything, understated.

:class:`ReservedAdmission` is that allocator on top of the block manager: a request is admitted only when blocks
for all of its ``prompt + max_tokens`` tokens are free, and its block table gets them all at once; decoding then
never takes a block, so nothing is ever preempted. :class:`PagedAdmission` changes nothing: blocks as tokens need
them. ``benchmarks/paged_vs_reserved.py`` measures the two side by side; ``tests/test_fidelity4_paged_vs_reserved.py``
checks the batch sizes against the arithmetic of the pool.
"""

from __future__ import annotations

from spinwheel.engine.kv.block_manager import AllocStatus, BlockManager
from spinwheel.engine.sequence import Sequence, SequenceGroup


class PagedAdmission:
    """PagedAttention's admission: the prompt's blocks now, each further block when a token needs it."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager

    def never_fits(self, group: SequenceGroup) -> str | None:
        return None

    def can_allocate(self, group: SequenceGroup, seqs: list[list[int]], shared: int, cached: bool) -> AllocStatus:
        """Whether the waiting ``group``'s sequences (these token lists) can get block tables now (see
        :meth:`BlockManager.can_allocate`)."""
        return self.block_manager.can_allocate(seqs, shared, cached, group.params.lora)

    def reserve(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        return None


class ReservedAdmission(PagedAdmission):
    """Orca's reservation: every block a request may ever use, taken when it is admitted."""

    def never_fits(self, group: SequenceGroup) -> str | None:
        if group.width > 1:
            return (
                f"kv_allocation='reserved' (Orca's baseline) serves one sequence per request, this one asks for "
                f"{group.width}; use kv_allocation='paged' for n > 1 or beam search"
            )
        return None

    def reserved_blocks(self, group: SequenceGroup) -> int:
        return self.block_manager.num_blocks_for(reserved_tokens(group))

    def can_allocate(self, group: SequenceGroup, seqs: list[list[int]], shared: int, cached: bool) -> AllocStatus:
        # All of prompt + max_tokens must be free (an upper bound of what allocate + reserve take: blocks the prefix
        # cache shares cost less); a request that fits the pool at all waits until they are.
        status = super().can_allocate(group, seqs, shared, cached)
        if status == AllocStatus.OK and self.reserved_blocks(group) > self.block_manager.num_free_blocks:
            return AllocStatus.LATER
        return status

    def reserve(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        """Grow the just-allocated tables to the request's whole reservation (fresh blocks: nothing is copied)."""
        for s in seqs:
            self.block_manager.append_slots(s.seq_id, s.num_tokens, reserved_tokens(group))


def reserved_tokens(group: SequenceGroup) -> int:
    """The longest the request may grow: prompt + ``max_tokens`` (what Orca reserves)."""
    return len(group.prompt_token_ids) + group.params.max_tokens


ADMISSIONS = {"paged": PagedAdmission, "reserved": ReservedAdmission}
