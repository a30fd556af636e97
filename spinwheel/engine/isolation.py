"""One request, one failure: an exception raised while a step processes one request's outputs — its prompt
logprobs, sampling with its parameters (penalties, bias, truncation), its stop checks, its beam-search step — fails
that request alone; the step goes on for the others.

:class:`RequestFailures` collects the failed requests of a step (the engine frees their blocks and reports them
with ``finish_reason`` "error" and an ``error`` starting with :data:`INTERNAL_ERROR`). The sampler runs once over
every row of the step; when that call raises, :func:`sample_isolated` samples each request's rows again on their
own, so the request whose rows raise is found and failed and the others get their tokens — the same tokens for
greedy and seeded requests, whose draws depend on nothing else in the batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from spinwheel.engine.outputs import RequestOutput
from spinwheel.engine.sampling.sampler import Sampler, SampleRow
from spinwheel.engine.sequence import SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

# How an error the request did not cause by what it asked for starts (the server answers 500 to it, not 400).
INTERNAL_ERROR = "internal error: "


class RequestFailures:
    """The requests that failed in the current step, by request id."""

    def __init__(self) -> None:
        self.groups: dict[str, SequenceGroup] = {}

    def __contains__(self, group: SequenceGroup) -> bool:
        return group.request_id in self.groups

    @contextlib.contextmanager
    def guard(self, group: SequenceGroup, stage: str) -> Iterator[None]:
        """Run the block; an exception in it fails ``group`` (at ``stage``, which the error names) and is
        swallowed, so the caller goes on with the next request."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failure of one request's processing fails that request only
            self.fail(group, stage, e)

    def fail(self, group: SequenceGroup, stage: str, error: BaseException) -> None:
        """Finish every unfinished sequence of ``group`` with "error" (its blocks are freed by the engine)."""
        if group in self:
            return
        logger.error("request %s failed in %s; the other requests go on", group.request_id, stage, exc_info=error)
        group.error = (
            f"{INTERNAL_ERROR}the engine failed on this request in {stage} ({type(error).__name__}: {error}); "
            "the other requests were not affected"
        )
        for s in group.unfinished_seqs():
            s.status = SequenceStatus.FINISHED_ERROR
        self.groups[group.request_id] = group

    def take(self) -> list[SequenceGroup]:
        """The failed groups, forgotten here."""
        groups, self.groups = list(self.groups.values()), {}
        return groups


def failed_output(group: SequenceGroup, error: Exception) -> RequestOutput:
    """The final output of a request whose output could not be built: no completions, and the error (the caller
    frees its blocks)."""
    RequestFailures().fail(group, "building its output", error)
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, [], True, error=group.error)


def sample_isolated(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SampleRow],
    owners: list[SequenceGroup],
    row_index: list[int],
    failures: RequestFailures,
) -> list[tuple[int, int, float, dict[int, float] | None]]:
    """(i, token, logprob, top logprobs) for each sample row ``rows[i]`` (its logits: row ``row_index[i]`` of
    ``logits`` (L, V); its request: ``owners[i]``) whose request has not failed: one batched call, and only when
    that raises one call per request."""
    keep = [i for i, g in enumerate(owners) if g not in failures]  # a request can fail while forking its samples
    if not keep:
        return []
    keep.sort(key=row_index.__getitem__)  # in the logits' row order: usually all rows, taken as they are (no copy)
    picked = [row_index[i] for i in keep]
    if picked != list(range(logits.shape[0])):  # n > 1 forks share a row; prompt rows are skipped
        logits = logits[torch.tensor(picked, device=logits.device)]  # (len(keep), V)
    batch = [rows[i] for i in keep]
    try:
        out = sampler(logits, batch)
        return list(zip(keep, out.token_ids, out.logprobs, out.top_logprobs))
    except Exception as e:  # noqa: BLE001 - which request caused it is found below
        if len({owners[i].request_id for i in keep}) == 1:
            failures.fail(owners[keep[0]], "sampling", e)
            return []
    by_request: dict[str, list[int]] = {}  # request id -> its positions in ``batch``
    for j, i in enumerate(keep):
        by_request.setdefault(owners[i].request_id, []).append(j)
    sampled: list[tuple[int, int, float, dict[int, float] | None]] = []
    for positions in by_request.values():
        with failures.guard(owners[keep[positions[0]]], "sampling"):
            out = sampler(logits[torch.tensor(positions, device=logits.device)], [batch[j] for j in positions])
            sampled += zip([keep[j] for j in positions], out.token_ids, out.logprobs, out.top_logprobs)
    return sampled
