"""One step of beam search, with Hugging Face ``generate(num_beams=k, do_sample=False)`` semantics
(transformers >= 4.50 ``_beam_search``), so the two produce the same hypotheses:

* every running beam's log-softmax is added to its cumulative log-prob; the best ``2k`` continuations over all
  beams are kept (``max(2, 1 + #eos) * k`` in general), best first;
* a continuation that ends (EOS, or the ``max_tokens``-th token) and ranks among the first ``k`` becomes a finished
  hypothesis scored ``sum_logprobs / generated_len ** length_penalty`` (the EOS token counts in the length); the
  ``k`` best finished hypotheses are kept;
* the next running beams are the best ``k`` continuations that did not end;
* search stops when all ``2k`` continuations end, when ``early_stopping=True`` and ``k`` hypotheses are finished,
  or when the best running beam — scored at its current length (``early_stopping=False``) or, for ``"never"``
  with a positive length penalty, at ``max_tokens`` — cannot beat the worst of ``k`` finished hypotheses.

The scheduler applies the decisions through the block manager: a beam chosen twice is forked (its blocks shared, the
last one copied on write), a beam not chosen is freed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spinwheel.engine.sampling_params import SamplingParams
from spinwheel.engine.sequence import FinishedBeam


@dataclass
class BeamChoice:
    parent: int  # index of the running beam it extends
    token_id: int
    cumulative_logprob: float


def beam_step(
    logprobs: torch.Tensor,
    scores: list[float],
    histories: list[list[int]],
    num_generated: int,
    params: SamplingParams,
    eos_ids: set[int],
    finished: list[FinishedBeam],
    improvable: bool,
) -> tuple[list[BeamChoice], list[FinishedBeam], bool, bool]:
    """logprobs (B, V) of the B running beams (1 right after the prompt), their cumulative log-probs ``scores``
    and generated tokens ``histories``; ``num_generated`` tokens generated so far.

    Returns (next running beams, finished hypotheses (best first, at most k), still improvable, done).
    """
    k, lp = params.n, params.length_penalty
    b, vocab = logprobs.shape
    acc = (logprobs.float() + torch.tensor(scores, dtype=torch.float32, device=logprobs.device)[:, None]).view(-1)
    n_eos = len(eos_ids) if not params.ignore_eos else 0
    keep = min(max(2, 1 + n_eos) * k, acc.numel())
    top_vals, top_idx = acc.topk(keep)
    ends_by_length = num_generated + 1 >= params.max_tokens
    full = params.early_stopping is True and len(finished) >= k
    new_finished: list[FinishedBeam] = []
    running: list[BeamChoice] = []
    all_end = True
    for rank, (val, idx) in enumerate(zip(top_vals.tolist(), top_idx.tolist())):
        parent, token = divmod(idx, vocab)
        is_eos = token in eos_ids and not params.ignore_eos
        ends = is_eos or ends_by_length
        all_end &= ends
        if ends:
            if rank < k and improvable and not full:
                new_finished.append(
                    FinishedBeam(
                        histories[parent] + [token],
                        val / (num_generated + 1) ** lp,
                        val,
                        "stop" if is_eos else "length",
                    )
                )
        elif len(running) < k:
            running.append(BeamChoice(parent, token, val))
    # keep the k best finished; earlier ones win ties (as torch.topk over [old, new] does in HF)
    merged = sorted(finished + new_finished, key=lambda f: -f.score)[:k]
    if improvable:
        if params.early_stopping == "never" and lp > 0:
            best_len = params.max_tokens
        else:
            best_len = num_generated + 1
        best_running = running[0].cumulative_logprob / best_len**lp if running else -math.inf
        # with fewer than k hypotheses the search goes on: a sentinel worst score of -1e9 in their place lost to the
        # scores of a negative length_penalty (-500 / 64**-10 = -6e20), and the search ended with no hypothesis
        improvable = len(merged) < k or best_running > min(f.score for f in merged)
    done = all_end or not improvable or (params.early_stopping is True and len(merged) >= k)
    return running, merged, improvable, done
