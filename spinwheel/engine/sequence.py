"""Requests and their sequences.

A request is a :class:`SequenceGroup`: one sequence, ``n`` parallel samples or ``k`` beams sharing one prompt. A
group starts with a single sequence; parallel samples and beams are forked from it once the prompt is computed, so
they share the prompt's KV blocks (Kwon et al., 2023, §4.4).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from spinwheel.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` ("stop", "length", "abort", "error"), None while unfinished."""
        return self.value if self.is_finished else None


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_ERROR,
}


class Sequence:
    """One token stream: the prompt, the tokens generated so far and how many of them have KV in the cache."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], index: int = 0) -> None:
        self.seq_id = seq_id
        self.index = index  # position among the group's outputs
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []  # per output token: {token_id: logprob}
        self.stop_reason: int | str | None = None
        self.text = ""  # detokenised output, maintained when stop strings or streaming need it
        self.pending_logprobs: torch.Tensor | None = None  # beam search: (V,) waiting for the other beams

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_prefill(self) -> bool:
        """True while more than one token lacks K/V (the prompt, or everything after a recompute preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None = None) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.logprobs.append(top_logprobs)

    def fork(self, seq_id: int, index: int) -> Sequence:
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.seq_id, child.index = seq_id, index
        child.token_ids = list(self.token_ids)
        child.logprobs = list(self.logprobs)
        child.pending_logprobs = None
        return child


@dataclass
class FinishedBeam:
    """A completed beam-search hypothesis (its blocks are already freed)."""

    token_ids: list[int]
    score: float  # cumulative log-prob / generated_len ** length_penalty
    cumulative_logprob: float
    finish_reason: str


@dataclass
class SequenceGroup:
    """One request: its sequences, sampling parameters and bookkeeping."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    # beam search state (HF semantics): finished hypotheses and whether the early-stop heuristic still allows gains
    finished_beams: list[FinishedBeam] = field(default_factory=list)
    beam_improvable: bool = True
    forked: bool = False  # parallel samples / beams created from the prompt sequence
    # after a recompute of a forked group: (the sequence recomputing the shared leading tokens, how many); the
    # others share its blocks and wait until it has computed them
    shared_prefill: tuple[Sequence, int] | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids: list[int] = self.seqs[0].prompt_token_ids
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
            self.prompt_logprob_ranks = [None]

    def seqs_with(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status == status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.is_finished]

    @property
    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    @property
    def width(self) -> int:
        """How many sequences this group will hold at most (n samples or n beams)."""
        return self.params.n
