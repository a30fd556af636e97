"""The ring all-reduce (reduce-scatter then all-gather over point-to-point sends, N − 1 steps each) is the backend's
all-reduce, and moves what the comm counters' formula says, on 3 spawned gloo ranks: N = 3 on all of them, N = 2 on
a group of ranks 0 and 1.

Ψ = the tensor's bytes. Each rank sends every chunk but one in each phase — 2Ψ − |chunk r + 1| − |chunk r + 2|,
within two elements of 2Ψ(N − 1)/N when N does not divide the size, exactly that when it does — and the ranks
together send 2Ψ(N − 1). :meth:`~spinwheel.parallel.comm.Comm.all_reduce` counts every all-reduce as 2Ψ (ZeRO's
accounting, the N → ∞ limit); the ring's measured bytes are that count times (N − 1)/N.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spinwheel.parallel import spawn
from spinwheel.parallel.comm import Comm, ring_all_reduce
from spinwheel.parallel.mesh import Axis

SHAPES = [(1,), (2,), (7,), (101,), (1001,), (1002,), (3, 5, 7)]  # 1002: N = 2 and 3 divide it


def _case(ranks: tuple[int, ...], group, shape: tuple[int, ...]) -> dict:
    axis = Axis(f"ring{len(ranks)}", ranks, ranks.index(dist.get_rank()), group)
    gen = torch.Generator().manual_seed(dist.get_rank())
    out = {}
    for dtype in (torch.float64, torch.float32):  # float32: small integers, whose sums are exact in any order
        x = torch.randn(shape, generator=gen, dtype=dtype)
        if dtype == torch.float32:
            x = x.mul(10).round()
        ring, backend = Comm(timeout_s=30), Comm(timeout_s=30)
        got, want = x.clone(), x.clone()
        ring_all_reduce(ring, got, axis)
        backend.all_reduce(want, axis)
        out[str(dtype)] = {
            "got": got.numpy().copy(),  # tensors would go by fd
            "want": want.numpy().copy(),
            "sent": ring.stats.bytes.get("send", 0),
            "counted": backend.stats.bytes["all_reduce"],
            "element_size": x.element_size(),
        }
    return out


def worker(rank: int, world_size: int) -> dict:
    groups = {(0, 1, 2): dist.new_group([0, 1, 2]), (0, 1): dist.new_group([0, 1])}  # every rank creates both
    out = {}
    for ranks, group in groups.items():
        if rank in ranks:
            for shape in SHAPES:
                out[len(ranks), shape] = _case(ranks, group, shape)
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return spawn(worker, 3, timeout_s=120)


def _cases(per_rank: list[dict], n: int):
    for rank, res in enumerate(per_rank[:n]):
        for shape in SHAPES:
            for dtype, case in res[n, shape].items():
                yield rank, shape, dtype, case


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("n", [2, 3])
def test_ring_all_reduce_equals_the_backends(per_rank, n):
    for rank, shape, dtype, case in _cases(per_rank, n):
        got, want = torch.from_numpy(case["got"]), torch.from_numpy(case["want"])
        if dtype == "torch.float32":
            assert torch.equal(got, want), (n, rank, shape)
        else:  # a different order of additions
            where = f"N={n} rank {rank} shape {shape}"
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("n", [2, 3])
def test_ring_sends_two_psi_times_n_minus_one_over_n(per_rank, n):
    totals: dict[tuple, int] = {}
    for rank, shape, dtype, case in _cases(per_rank, n):
        size, numel = case["element_size"], int(torch.tensor(shape).prod())
        psi = numel * size
        chunks = [len(c) for c in torch.arange(numel).tensor_split(n)]
        assert case["sent"] == 2 * psi - size * (chunks[(rank + 1) % n] + chunks[(rank + 2) % n]), (n, rank, shape)
        assert abs(case["sent"] - 2 * psi * (n - 1) / n) < 2 * size  # chunking rounds by under one element a phase
        assert case["counted"] == 2 * psi  # the comm counters' formula for an all-reduce
        assert abs(case["sent"] - case["counted"] * (n - 1) / n) < 2 * size
        if numel % n == 0:
            assert case["sent"] * n == case["counted"] * (n - 1)
        totals[psi, dtype] = totals.get((psi, dtype), 0) + case["sent"]
    for (psi, _), total in totals.items():  # the ranks together send each chunk 2(N − 1) times
        assert total == 2 * (n - 1) * psi
