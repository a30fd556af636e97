"""Token sampling over a batch of logits rows, each with its own :class:`SamplingParams`.

Order of operations (as HF's logits processors and vLLM apply them): penalties (repetition on prompt + output,
presence/frequency on the output), ``logit_bias`` (added to the logits), ``min_tokens`` masking of stop tokens,
temperature (below ``SAMPLING_EPS``: greedy), then top-k, top-p and min-p truncation, then a draw. Draws use the
exponential race (``argmax p_i / E_i`` with ``E_i ~ Exp(1)``), which samples exactly from ``p``. A request with a
``seed`` draws its noise from a counter-based generator (:func:`seeded_exponential`): a hash of (seed, sample index,
output position, token), so its tokens depend neither on what else shares the batch nor on preemption, and every
seeded row of a step is drawn in one vectorised pass instead of one generator call per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spinwheel.engine.kernels.cpu_kernels import greedy_rows
from spinwheel.engine.sampling_params import SamplingParams
from spinwheel.engine.sequence import Sequence

# Temperatures below this are greedy (vLLM's threshold): logits / T overflows float32 for T around 1e-37 and below
# (and T < 1e-45 is 0 in float32), giving NaN probabilities; at T = 1e-5 the distribution is an argmax already.
SAMPLING_EPS = 1e-5


@dataclass
class SampleRow:
    seq: Sequence
    params: SamplingParams
    stop_ids: list[int]  # ids masked while fewer than min_tokens are generated (EOS + stop_token_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw log-prob of each chosen token
    top_logprobs: list[dict[int, float] | None]  # when the row's params ask for logprobs


_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores (two's complement)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (multiplication wraps modulo 2^64): a bijection whose outputs
    pass BigCrush for consecutive inputs (Steele, Lea & Flood 2014)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def seeded_exponential(seeds: list[int], indices: list[int], positions: list[int], vocab: int, device) -> torch.Tensor:
    """Exp(1) noise (R, vocab), row r a pure function of (``seeds[r]``, sample ``indices[r]``, output ``positions[r]``)
    and the token: ``E = −log U`` with ``U`` the top 53 bits of a double SplitMix64 hash, in (0, 1]."""
    rows = [
        _signed(seed * 1_000_003 + index) for seed, index in zip(seeds, indices)
    ]  # the request's sample stream: seed and sample index, as seeded n > 1 requests number their samples
    keys = _splitmix64(torch.tensor(rows, dtype=torch.int64, device=device))
    keys = _splitmix64(keys ^ _splitmix64(torch.tensor(positions, dtype=torch.int64, device=device)))
    tokens = torch.arange(vocab, dtype=torch.int64, device=device) * _GOLDEN
    bits = _splitmix64(keys[:, None] ^ tokens[None, :])
    u = (_shr(bits, 11) + 1).to(torch.float64) * 2.0**-53  # (0, 1]
    return (-torch.log(u)).to(torch.float32).clamp_min_(torch.finfo(torch.float32).tiny)


def top_logprobs(logprobs: torch.Tensor, token_id: int, k: int) -> dict[int, float]:
    """{token: logprob} for the top ``k`` tokens of one row (all of them when ``k`` exceeds the vocabulary) plus
    the chosen one."""
    out = {token_id: float(logprobs[token_id])}
    if k > 0:
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]))
        for i, lp in zip(ids.tolist(), values.tolist()):
            out.setdefault(i, lp)
    return out


def _changes_logits(row: SampleRow) -> bool:
    """True when penalties, a logit bias or min_tokens masking apply to this row's logits at this step."""
    p = row.params
    return bool(p.needs_penalties or p.logit_bias or (p.min_tokens and row.seq.num_output_tokens < p.min_tokens))


def _plain_greedy(row: SampleRow) -> bool:
    """Greedy with nothing but the chosen token's log-prob to report: the argmax of the raw logits."""
    return row.params.temperature < SAMPLING_EPS and row.params.logprobs is None and not _changes_logits(row)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """logits (R, V) -> one token per row."""
        logits = logits.float()
        r = logits.shape[0]
        if all(_plain_greedy(row) for row in rows):  # greedy, nothing to apply: one fused pass per row on CPU
            fast = greedy_rows(logits)
            if fast is not None:
                return SamplerOutput(fast[0], fast[1], [None] * r)
        want_logprobs = [row.params.logprobs is not None for row in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        raw = logits
        logits = self._apply_penalties(logits, rows)
        processed = [i for i, row in enumerate(rows) if row.params.logprobs_mode == "processed" and want_logprobs[i]]
        if processed:  # the drawing distribution before truncation: penalised logits / T
            assert raw_logprobs is not None
            index = torch.tensor(processed, device=logits.device)
            temps = [max(rows[i].params.temperature, SAMPLING_EPS) for i in processed]
            scaled = logits[index] / torch.tensor(temps, device=logits.device)[:, None]
            raw_logprobs = raw_logprobs.clone()
            raw_logprobs[index] = torch.log_softmax(scaled, dim=-1)
        is_greedy = [row.params.temperature < SAMPLING_EPS for row in rows]
        greedy = torch.tensor(is_greedy, device=logits.device)
        if all(is_greedy):
            tokens = logits.argmax(dim=-1)
        else:
            temps = torch.tensor(
                [1.0 if g else row.params.temperature for g, row in zip(is_greedy, rows)], device=logits.device
            )
            scaled = logits / temps[:, None]
            scaled = self._truncate(scaled, rows)
            probs = torch.softmax(scaled, dim=-1)
            noise = torch.empty_like(probs)
            seeded = [i for i, row in enumerate(rows) if row.params.seed is not None]
            if len(seeded) < r:
                noise.exponential_(generator=self._generator(logits.device))
            if seeded:
                picked = [rows[i] for i in seeded]
                drawn = seeded_exponential(
                    [row.params.seed for row in picked],  # type: ignore[misc]
                    [row.seq.index for row in picked],
                    [row.seq.num_output_tokens for row in picked],
                    noise.shape[1],
                    noise.device,
                )
                if len(seeded) == r:
                    noise = drawn
                else:
                    noise[torch.tensor(seeded, device=noise.device)] = drawn
            sampled = (probs / noise).argmax(dim=-1)
            tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)

        token_list = tokens.tolist()
        if raw_logprobs is None:  # the cumulative log-prob is always reported: one logsumexp over the batch
            picked = raw.gather(1, tokens[:, None])[:, 0]
            return SamplerOutput(token_list, (picked - torch.logsumexp(raw, dim=-1)).tolist(), [None] * r)
        chosen_lp = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        tops: list[dict[int, float] | None] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k == 0:  # only the chosen token: no tensor indexing per row
                tops.append({token_list[i]: chosen_lp[i]})
            else:
                tops.append(top_logprobs(raw_logprobs[i], token_list[i], k) if k is not None else None)
        return SamplerOutput(token_list, chosen_lp, tops)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        need = [i for i, row in enumerate(rows) if _changes_logits(row)]
        if not need:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in need:
            p, seq = rows[i].params, rows[i].seq
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
                vals = row[seen]
                row[seen] = torch.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(out, minlength=vocab).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=logits.device)
            if p.min_tokens and seq.num_output_tokens < p.min_tokens and rows[i].stop_ids:
                row[torch.tensor(rows[i].stop_ids, dtype=torch.long, device=logits.device)] = float("-inf")
        return logits

    @staticmethod
    def _truncate(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """top-k, top-p and min-p as row-wise masks (one sort for the whole batch when any row needs it)."""
        top_k = [row.params.top_k for row in rows]
        top_p = [row.params.top_p for row in rows]
        min_p = [row.params.min_p for row in rows]
        vocab = logits.shape[1]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            drop = ranks >= ks[:, None]
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            ps = torch.tensor(top_p, device=logits.device, dtype=probs.dtype)
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            drop |= before > ps[:, None]
            drop[:, 0] = False  # always keep the most likely token
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        if any(m > 0 for m in min_p):
            probs = torch.softmax(logits, dim=-1)
            ms = torch.tensor(min_p, device=logits.device, dtype=probs.dtype)
            logits = logits.masked_fill(probs < ms[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits
