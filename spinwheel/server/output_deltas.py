"""What crosses the pipe from the engine process each step: only what is new per request, no text.

Like vLLM V1's ``EngineCoreOutput``: per request and step a :class:`RequestDelta` with, per sample, the new output
token ids, their logprobs entries (when requested), the cumulative logprob and the finish / stop reason; the prompt
logprobs once; the error and the metrics timestamps. The engine process (:class:`DeltaEncoder`) reads them off its
sequence groups in O(new tokens), decodes nothing and checks no stop strings. Beam search, whose finished
hypotheses replace the running beams, sends its outputs whole each step (token ids only): correct, not fast.

The API process (:class:`DeltaDecoder`) rebuilds the cumulative :class:`~spinwheel.engine.RequestOutput` the engine
would have produced in-process: it detokenizes the new tokens (:class:`~spinwheel.engine.detokenizer.OutputText`,
the engine's own class, so text and stop-string cuts are the same in every mode) and checks the stop strings on the
new text. A sample that hits one is finished there (later tokens the engine produced are dropped, as vLLM does) and
a command for the engine is queued (:meth:`DeltaDecoder.take_commands`): ``("stop", request_id, index, stop)`` for
one sample of several, ``("abort", request_id)`` once the whole request is done, so that its blocks are freed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from spinwheel.engine import CompletionOutput, RequestOutput, SamplingParams
from spinwheel.engine.detokenizer import OutputText
from spinwheel.engine.output_processor import OutputProcessor
from spinwheel.engine.sequence import SequenceGroup, SequenceStatus
from spinwheel.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING


class SampleDelta(NamedTuple):
    """One sample's (sequence's) news of a step."""

    index: int
    token_ids: list[int]  # output tokens new since the previous delta
    logprobs: list[dict[int, float]] | None  # their {token_id: logprob} entries, when the request asked for them
    cumulative_logprob: float
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(NamedTuple):
    request_id: str
    samples: list[SampleDelta]  # the samples with news
    finished: bool
    metrics: dict[str, float] | None  # arrival and first token times (first delta), finish time (last); monotonic
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the request's first delta
    prompt_logprob_ranks: list[int | None] | None = None
    error: str | None = None
    beams: list[CompletionOutput] | None = None  # beam search: all its outputs, without text


class _Sent(NamedTuple):
    num_tokens: int
    num_logprobs: int
    finished: bool


class DeltaEncoder:
    """Engine side: a step's groups -> their deltas. It remembers, per request and sample, how much was sent;
    a request's state goes with its finished delta (or :meth:`forget`, for one that failed without it)."""

    def __init__(self, output_processor: OutputProcessor) -> None:
        self.output_processor = output_processor  # builds beam-search outputs (no tokenizer: no text)
        self._sent: dict[str, dict[int, _Sent]] = {}

    def encode(self, group: SequenceGroup) -> RequestDelta:
        first = group.request_id not in self._sent
        sent = self._sent.setdefault(group.request_id, {})
        samples: list[SampleDelta] = []
        beams = None
        if group.params.use_beam_search:
            beams = self.output_processor.request_output(group).outputs
            finished = group.is_finished
        else:
            want_logprobs, finished = group.params.logprobs is not None, True
            for s in group.seqs:
                status = s.status  # compared by identity: an enum's hash and properties cost Python calls
                reason = None if status is _RUNNING else status.finish_reason
                finished = finished and reason is not None
                old = sent.get(s.index)
                start = s.num_prompt_tokens + (0 if old is None else old.num_tokens)
                if old is not None and len(s.token_ids) == start and (reason is not None) == old.finished:
                    continue
                new_lps = s.logprobs[0 if old is None else old.num_logprobs :] if want_logprobs else None
                samples.append(
                    SampleDelta(s.index, s.token_ids[start:], new_lps, s.cumulative_logprob, reason, s.stop_reason)
                )
                sent[s.index] = _Sent(len(s.token_ids) - s.num_prompt_tokens, len(s.logprobs), reason is not None)
        metrics = None
        if first or finished:  # the first delta has the arrival and first token times, the last the finish time
            metrics = {"arrival_time": group.arrival_time}
            if group.first_token_time is not None:
                metrics["first_token_time"] = group.first_token_time
            if group.finish_time is not None:
                metrics["finish_time"] = group.finish_time
        if finished:
            del self._sent[group.request_id]
        return RequestDelta(
            group.request_id,
            samples,
            finished,
            metrics,
            group.prompt_logprobs if first else None,
            group.prompt_logprob_ranks if first else None,
            group.error if finished else None,
            beams,
        )

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sent)


@dataclass
class _Sample:
    text: OutputText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self, index: int) -> CompletionOutput:
        # copies: a handler may still read the previous output while the next step's tokens arrive
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(
            index,
            self.text.text,
            list(self.token_ids),
            self.cumulative_logprob,
            logprobs,
            self.finish_reason,
            self.stop_reason,
        )


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[int, _Sample] = field(default_factory=dict)
    num_finished: int = 0  # samples with a finish reason
    metrics: dict[str, float] = field(default_factory=dict)  # replaced, never changed: outputs share it
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None


class DeltaDecoder:
    """API side: deltas -> the cumulative outputs, text detokenized here. A request is :meth:`add`-ed before its
    first delta can arrive; deltas of requests it does not hold (forgotten, or finished here by a stop string
    while the engine ran on) are dropped."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._commands: list[tuple] = []

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._requests[request_id] = _Request(prompt, prompt_token_ids, params)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def take_commands(self) -> list[tuple]:
        """The engine commands the deltas decoded so far call for (stop a sample, abort a request)."""
        commands, self._commands = self._commands, []
        return commands

    def decode_all(self, deltas: list[RequestDelta]) -> tuple[list[RequestOutput], list[tuple[str, Exception]]]:
        """The outputs of a step's deltas, and (request id, exception) for each request whose delta could not be
        decoded (its text, its stop strings): that request alone fails — forgotten here, aborted in the engine."""
        outputs, failed = [], []
        for delta in deltas:
            try:
                out = self.decode(delta)
            except Exception as e:  # noqa: BLE001 - one request's failure; the others' outputs go on
                logger.error("request %s failed decoding its output; the others go on", delta.request_id, exc_info=e)
                self.forget(delta.request_id)
                self._commands.append(("abort", delta.request_id))
                failed.append((delta.request_id, e))
                continue
            if out is not None:
                outputs.append(out)
        return outputs, failed

    def decode(self, delta: RequestDelta) -> RequestOutput | None:
        req = self._requests.get(delta.request_id)
        if req is None:
            return None
        if delta.metrics:
            req.metrics = {**req.metrics, **delta.metrics}
        if delta.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_logprob_ranks = delta.prompt_logprobs, delta.prompt_logprob_ranks
        if delta.beams is not None:
            decode = self.tokenizer.decode
            skip = req.params.skip_special_tokens
            outputs = [replace(c, text=decode(c.token_ids, skip_special_tokens=skip)) for c in delta.beams]
            finished = delta.finished
        else:
            stopped = [d.index for d in delta.samples if self._apply(req, d)]
            samples = req.samples
            finished = delta.finished or req.num_finished == req.params.n
            if finished and not delta.finished:  # done here, by stop strings: the engine is still at it
                self._commands.append(("abort", delta.request_id))
                req.metrics = {**req.metrics, "finish_time": time.monotonic()}
            elif not finished:
                self._commands += [("stop", delta.request_id, i, samples[i].stop_reason) for i in stopped]
            outputs = [samples[i].output(i) for i in sorted(samples)]
        if finished:
            del self._requests[delta.request_id]
        return RequestOutput(
            delta.request_id,
            req.prompt,
            req.prompt_token_ids,
            outputs,
            finished,
            req.prompt_logprobs,
            delta.error,
            req.metrics,
            req.prompt_logprob_ranks,
        )

    def _apply(self, req: _Request, d: SampleDelta) -> bool:
        """Add a sample's news; True if a stop string finished it here."""
        sample = req.samples.get(d.index)
        if sample is None:
            sample = req.samples[d.index] = _Sample(OutputText(self.tokenizer, req.params))
            if req.params.logprobs is not None:
                sample.logprobs = []
        if sample.finish_reason is not None:
            return False  # finished (here, by a stop string): what the engine made after it is dropped
        # the engine checks no stop string on a token that ended the sample itself (EOS, a stop token id)
        by_token = d.finish_reason == "stop"
        for k, token in enumerate(d.token_ids):
            stop = sample.text.append([token], check_stop=not (by_token and k == len(d.token_ids) - 1))
            if stop is not None:
                sample.token_ids += d.token_ids[: k + 1]
                if sample.logprobs is not None and d.logprobs:
                    sample.logprobs += d.logprobs[: k + 1]
                # exact: a step brings one token per sample, so the hit is at this delta's last token
                sample.cumulative_logprob = d.cumulative_logprob
                sample.finish_reason, sample.stop_reason = "stop", stop
                req.num_finished += 1
                return True
        sample.token_ids += d.token_ids
        if sample.logprobs is not None and d.logprobs:
            sample.logprobs += d.logprobs
        sample.cumulative_logprob = d.cumulative_logprob
        if d.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = d.finish_reason, d.stop_reason
            sample.text.finish()
            req.num_finished += 1
        return False
