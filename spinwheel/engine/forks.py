"""The sequences sampling creates and drops: the ``n - 1`` forks of parallel sampling, the forks and ends of beam
search. A part of :class:`~spinwheel.engine.scheduler.Scheduler` (a mixin), so that block tables change in one
place; it uses the scheduler's ``block_manager`` and ``next_seq_id``."""

from __future__ import annotations

from spinwheel.engine.kv.block_manager import BlockManager
from spinwheel.engine.sampling.beam_search import BeamChoice
from spinwheel.engine.sequence import Sequence, SequenceGroup, SequenceStatus


class SamplingForks:
    block_manager: BlockManager

    def next_seq_id(self) -> int:  # the scheduler's
        raise NotImplementedError

    def fork_samples(self, group: SequenceGroup, seq: Sequence) -> list[Sequence]:
        """The prompt sequence's first token is due: fork the other ``n - 1`` samples (once per request), sharing
        its blocks. Returns the sequences that sample from this row."""
        if group.forked:
            return [seq]
        group.forked = True
        samples = [seq]
        for i in range(1, group.params.n):
            child = seq.fork(self.next_seq_id(), i)
            self.block_manager.fork(seq.seq_id, child.seq_id)
            group.seqs.append(child)  # at once: a request failing later in the step frees every block it holds
            samples.append(child)
        return samples

    def continue_beams(self, group: SequenceGroup, beams: list[Sequence], choices: list[BeamChoice]) -> None:
        """Apply one beam-search step: a beam chosen ``m`` times keeps one continuation and lends its blocks to
        ``m - 1`` forks (forked before the token is appended); a beam not chosen ends and frees its blocks. No
        choices: the search is done."""
        group.forked = True
        by_parent: dict[int, list[BeamChoice]] = {}
        for c in choices:
            by_parent.setdefault(c.parent, []).append(c)
        survivors: list[Sequence] = []
        for i, beam in enumerate(beams):
            picks = by_parent.get(i, [])
            if not picks:
                beam.status = SequenceStatus.FINISHED_ABORTED
                self.block_manager.free(beam.seq_id)
                continue
            forks = []
            for _ in picks[1:]:
                child = beam.fork(self.next_seq_id(), 0)
                self.block_manager.fork(beam.seq_id, child.seq_id)
                group.seqs.append(child)  # held by the group at once (see fork_samples); replaced below
                forks.append(child)
            for seq, c in zip([beam] + forks, picks):
                seq.token_ids.append(c.token_id)
                seq.cumulative_logprob = c.cumulative_logprob
                survivors.append(seq)
        group.seqs = survivors  # dropped beams are already freed
