"""What the scheduler hands to the model runner and the engine for one step: the sequences to compute (each with
the chunk it computes), the block moves to perform first, and the requests that failed."""

from __future__ import annotations

from dataclasses import dataclass, field

from spinwheel.engine.sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSequence:
    """A sequence and the chunk of tokens it computes this step."""

    seq: Sequence
    group: SequenceGroup
    num_new_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens
    completes: bool = False  # after this step every token has K/V, so the next token is sampled
    scores_prompt: bool = False  # the request wants prompt logprobs for this chunk's tokens

    def __post_init__(self) -> None:
        seq, params = self.seq, self.group.params
        self.completes = seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens
        # once the group has forked its prompt logprobs are complete (a recompute does not score them again)
        self.scores_prompt = (
            params.prompt_logprobs is not None
            and not self.group.forked
            and seq.num_computed_tokens < seq.num_prompt_tokens
        )


@dataclass
class SchedulerOutput:
    """One step's plan; the runner moves blocks (swap-out, swap-in, copies) before it computes ``scheduled``."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), device
    failed: list[SequenceGroup] = field(default_factory=list)  # finished with an error this step
    num_preempted: int = 0
    block_tables: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> device blocks (the manager's)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)
