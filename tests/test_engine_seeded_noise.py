"""The counter-based noise of seeded requests: SplitMix64 bit for bit, Exp(1) in distribution, the exponential race
with it samples from p, and each row depends only on its own (seed, sample index, position)."""

import math

import torch

from spinwheel.engine.sampling.sampler import Sampler, SampleRow, seeded_exponential
from spinwheel.engine.sampling_params import SamplingParams

M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The published SplitMix64 output function on Python ints (unsigned 64-bit), the reference for the tensors."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def reference_noise(seed: int, index: int, position: int, vocab: int) -> list[float]:
    key = splitmix64((seed * 1_000_003 + index) & M64)
    key = splitmix64(key ^ splitmix64(position & M64))
    out = []
    for v in range(vocab):
        bits = splitmix64(key ^ ((v * 0x9E3779B97F4A7C15) & M64))
        out.append(-math.log(((bits >> 11) + 1) * 2.0**-53))
    return out


def test_noise_is_splitmix64_bit_for_bit():
    cases = [(0, 0, 0), (123, 3, 7), (2**40 + 5, 1, 1000), (2**63 + 11, 2, 3)]  # seeds past int64 wrap too
    got = seeded_exponential([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases], 50, "cpu")
    for row, (seed, index, pos) in zip(got, cases):
        want = torch.tensor(reference_noise(seed, index, pos, 50), dtype=torch.float32)
        assert torch.equal(row, want), (seed, index, pos)


def test_noise_is_exponential_and_rows_are_independent_of_the_batch():
    n = 4000
    e = seeded_exponential([7] * n, [0] * n, list(range(n)), 64, "cpu").double()  # (n, 64)
    assert abs(e.mean().item() - 1) < 0.01 and abs(e.var().item() - 1) < 0.03
    u = torch.exp(-e).flatten()  # uniform on (0, 1] if e is Exp(1)
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 43.8  # χ²(19) at p = 0.001
    # neighbouring positions and tokens are uncorrelated
    assert abs(torch.corrcoef(torch.stack([e[:-1].flatten(), e[1:].flatten()]))[0, 1].item()) < 0.02
    alone = seeded_exponential([7], [0], [5], 64, "cpu")
    assert torch.equal(alone[0], e[5].float())
    other = seeded_exponential([7, 7, 8], [1, 0, 0], [5, 6, 5], 64, "cpu")
    assert not torch.equal(other[0], alone[0]) and not torch.equal(other[2], alone[0])


class _Seq:
    def __init__(self, index: int, num_output_tokens: int) -> None:
        self.index, self.num_output_tokens = index, num_output_tokens
        self.token_ids, self.output_token_ids = [], []


def test_seeded_race_samples_from_the_distribution():
    """Seeded draws (one per seed) of a fixed 6-token distribution: frequencies match p (χ² test)."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    logits = p.log()[None].expand(3000, -1).contiguous()
    rows = [SampleRow(_Seq(0, 0), SamplingParams(temperature=1.0, seed=s), [2]) for s in range(3000)]
    tokens = torch.tensor(Sampler()(logits, rows).token_ids)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = 3000 * p.double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # χ²(5) at p = 0.001
    # the same rows again, now batched with unseeded ones: the seeded tokens do not change
    mixed = rows[:10] + [SampleRow(_Seq(0, 0), SamplingParams(temperature=1.0), [2]) for _ in range(5)]
    again = Sampler()(p.log()[None].expand(15, -1).contiguous(), mixed).token_ids[:10]
    assert again == tokens[:10].tolist()
