"""From sampled tokens to what a caller sees: stop checks, prompt logprobs and :class:`RequestOutput` building.

The engine appends each sampled token to its sequence and asks :meth:`OutputProcessor.check_stop` whether the
sequence is done (a stop token, EOS once ``min_tokens`` are out, a stop string in the detokenised text, ``max_tokens``
or the model context); :meth:`OutputProcessor.request_output` turns a group into its cumulative output. Text is
decoded incrementally (:class:`~spinwheel.engine.detokenizer.OutputText`, only the new tokens of a step) for the
sequences whose text is needed before they finish (stop strings, streaming); an output first needed when it is
finished (offline generation) is decoded once, whole. An output processor without a tokenizer decodes nothing and
checks no stop strings: the engine process's, whose API process does both.
"""

from __future__ import annotations

import torch

from spinwheel.engine.detokenizer import OutputText
from spinwheel.engine.model_runner import StepLogits
from spinwheel.engine.outputs import CompletionOutput, RequestOutput
from spinwheel.engine.sampling.sampler import top_logprobs
from spinwheel.engine.sampling_params import SamplingParams
from spinwheel.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from spinwheel.models.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self._texts: dict[int, OutputText] = {}  # seq_id -> its text so far, for sequences still running

    def _text(self, seq: Sequence, params: SamplingParams) -> OutputText:
        assert self.tokenizer is not None
        text = self._texts.get(seq.seq_id)
        if text is None:
            text = self._texts[seq.seq_id] = OutputText(self.tokenizer, params)
        return text

    def check_stop(self, seq: Sequence, params: SamplingParams) -> None:
        """Finish ``seq`` if its last token ends it; a stop string also cuts ``seq.text`` where it starts (or, with
        ``include_stop_str_in_output``, where it ends)."""
        token = seq.token_ids[-1]
        if token in params.stop_token_ids:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif not params.ignore_eos and token in self.eos_ids and seq.num_output_tokens >= params.min_tokens:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif params.stop and self.tokenizer is not None:
            text = self._text(seq, params)
            stop = text.sync(seq.token_ids, seq.num_prompt_tokens)
            if stop is not None:
                seq.text = text.text
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        if not seq.status.is_finished and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.status = SequenceStatus.FINISHED_LENGTH

    @staticmethod
    def record_prompt_logprobs(group: SequenceGroup, seq: Sequence, step: StepLogits, num_new: int) -> None:
        """Append the prompt logprobs (and each prompt token's rank, 1 = most likely) of the chunk of ``num_new``
        tokens starting at ``seq.num_computed_tokens``: row i of the chunk predicts prompt token start + i + 1.
        Positions already recorded (a chunk computed again after a recompute preemption) are skipped; such
        requests do not read the prefix cache, so every position has its row."""
        start_row, _ = step.prompt_rows[seq.seq_id]
        lps, ranks = group.prompt_logprobs, group.prompt_logprob_ranks
        assert lps is not None and ranks is not None
        first = seq.num_computed_tokens
        assert len(lps) > first, "a request scoring its prompt read K/V from the prefix cache"
        # rows predicting prompt positions not recorded yet: [lo, hi) of this chunk
        lo, hi = max(0, len(lps) - first - 1), min(num_new, seq.num_prompt_tokens - first - 1)
        if lo >= hi:
            return
        rows = torch.log_softmax(step.logits[start_row + lo : start_row + hi], dim=-1)  # (hi - lo, V)
        targets = torch.tensor(seq.token_ids[first + lo + 1 : first + hi + 1], device=rows.device)
        chosen = rows.gather(1, targets[:, None])  # (hi - lo, 1)
        ranks += ((rows > chosen).sum(dim=-1) + 1).tolist()
        k = group.params.prompt_logprobs or 0
        for i, token in enumerate(targets.tolist()):
            lps.append(top_logprobs(rows[i], token, k))

    def decode(self, ids: list[int], params: SamplingParams) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def output_text(self, seq: Sequence, params: SamplingParams) -> str:
        """``seq``'s text: cut at its stop string, else decoded incrementally while it runs (and when it finishes,
        if it was decoded so before), else whole."""
        if isinstance(seq.stop_reason, str):
            return seq.text
        if self.tokenizer is None:
            return ""
        finished = seq.status.is_finished
        text = self._texts.get(seq.seq_id)
        if text is None and finished:
            return self.decode(seq.output_token_ids, params)
        text = text or self._text(seq, params)
        text.sync(seq.token_ids, seq.num_prompt_tokens, check_stop=False)
        return text.finish() if finished else text.text

    def forget(self, group: SequenceGroup) -> None:
        """Drop the text state of a finished group's sequences."""
        for s in group.seqs:
            self._texts.pop(s.seq_id, None)

    def request_output(self, group: SequenceGroup) -> RequestOutput:
        """The group's cumulative output: one completion per sample, or per beam (finished hypotheses, best first,
        once the search is done)."""
        params = group.params
        outs: list[CompletionOutput] = []
        if params.use_beam_search:
            if group.is_finished and group.error is None and group.finished_beams:
                for i, f in enumerate(group.finished_beams):
                    outs.append(
                        CompletionOutput(
                            i,
                            self.decode(f.token_ids, params),
                            list(f.token_ids),
                            f.cumulative_logprob,
                            None,
                            f.finish_reason,
                            score=f.score,
                        )
                    )
            else:
                reason = None if not group.is_finished else ("error" if group.error else "abort")
                for i, s in enumerate(group.seqs or []):
                    outs.append(
                        CompletionOutput(
                            i,
                            self.decode(s.output_token_ids, params),
                            s.output_token_ids,
                            s.cumulative_logprob,
                            None,
                            reason,
                        )
                    )
        else:
            for s in sorted(group.seqs, key=lambda s: s.index):
                outs.append(
                    CompletionOutput(
                        s.index,
                        self.output_text(s, params),
                        s.output_token_ids,
                        s.cumulative_logprob,
                        s.logprobs if params.logprobs is not None else None,
                        s.status.finish_reason,
                        s.stop_reason,
                    )
                )
        if group.is_finished:
            self.forget(group)
        metrics = {"arrival_time": group.arrival_time}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        if group.finish_time is not None:
            metrics["finish_time"] = group.finish_time
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            outs,
            group.is_finished,
            group.prompt_logprobs,
            group.error,
            metrics,
            group.prompt_logprob_ranks,
        )
