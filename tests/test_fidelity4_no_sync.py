"""``no_sync`` really skips communication (Li et al., 2020, "PyTorch Distributed", §3.2.4): gradient accumulation
over M micro-batches reduces once per step, not M times — counted on the wire, below the comm layer's own books
(:func:`~spinwheel.parallel.counting.counting_backend`), on 2 spawned gloo ranks.

Formula, per step of M micro-batches over a model of Ψ parameters cut into B gradient buckets, N ranks:

* DDP: B all-reduces, 2Ψ(N − 1)/N elements sent per rank by the ring — the same for every M;
* ZeRO-1: B reduce-scatters (Ψ(N − 1)/N), whatever M;
* ZeRO-2 (the contrast): its gradients are sharded, so every backward reduce-scatters: M·B calls.

Averaging is linear, so a DDP that all-reduced every micro-batch would train to the same numbers: only a count of
the collectives can tell the skip is there (remove ``if not self._sync: return`` from ``DistributedDataParallel.
_grad_ready`` and the DDP test fails with M·B calls).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.counting import counting_backend

WORLD, VOCAB, ROWS, T = 2, 64, 8, 12
LAYOUTS = {"ddp": dict(), "zero1": dict(zero=1), "zero2": dict(zero=2)}
MICROBATCHES = (1, 2, 4)
BUCKET_MB = 0.02  # ~5k fp32 elements: several buckets, so "once per bucket" and "once per step" differ in count


def _trainer(layout: str, microbatches: int = 1) -> ParallelTrainer:
    model = Transformer(preset_config("test", VOCAB)).init_weights(seed=0)
    config = ParallelConfig(**LAYOUTS[layout], bucket_mb=BUCKET_MB, microbatches=microbatches)
    return ParallelTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), config)


def _accumulate(wrapper, microbatches: list[torch.Tensor]) -> None:
    """The accumulation loop every data-parallel trainer runs: no_sync on all but the last micro-batch."""
    for i, ids in enumerate(microbatches):
        with wrapper.no_sync() if i < len(microbatches) - 1 else nullcontext():
            wrapper(ids).float().pow(2).mean().backward()


def _buckets(wrapper) -> list[int]:
    """Elements of each gradient bucket (padded to a multiple of N under ZeRO)."""
    if hasattr(wrapper, "buckets"):
        return [bk.flat.numel() for bk in wrapper.buckets]
    return [b.buffer.numel() for b in wrapper._buckets]


def worker(rank: int, world_size: int) -> dict:
    ids = torch.randint(0, VOCAB, (ROWS, T), generator=torch.Generator().manual_seed(rank))
    out = {}
    for layout in LAYOUTS:
        for m in MICROBATCHES:
            trainer = _trainer(layout)
            wrapper = trainer.pm.module
            with counting_backend() as wire:
                _accumulate(wrapper, list(ids.chunk(m)))
            out[layout, m] = dict(calls=dict(wire.calls), sent=dict(wire.sent), buckets=_buckets(wrapper))
        # The whole training step (its loss report included) communicates the same for M = 1 and M = 4.
        for m in (1, 4):
            trainer = _trainer(layout, microbatches=m)
            labels = torch.roll(ids, -1, dims=1)
            with counting_backend() as wire:
                trainer.step(ids.repeat(WORLD, 1), labels.repeat(WORLD, 1), torch.ones(ROWS * WORLD, T))
            out[layout, "step", m] = dict(calls=dict(wire.calls), sent=dict(wire.sent))
    return out


@pytest.fixture(scope="module")
def counted() -> list[dict]:
    return spawn(worker, WORLD, timeout_s=180)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout, op", [("ddp", "all_reduce"), ("zero1", "reduce_scatter")])
def test_accumulation_reduces_once_per_step(counted, layout, op):
    for rank, res in enumerate(counted):
        for m in MICROBATCHES:
            got = res[layout, m]
            num_buckets, psi = len(got["buckets"]), sum(got["buckets"])
            assert num_buckets >= 3, got["buckets"]
            assert got["calls"] == {op: num_buckets}, (rank, layout, m, got["calls"])  # B, not M·B
            # N = 2: a ring step sends one of two chunks; all-reduce = 2 phases, reduce-scatter = 1
            phases = 2 if op == "all_reduce" else 1
            assert got["sent"] == {op: phases * psi * 4 // 2}, (rank, layout, m, got["sent"])


@pytest.mark.slow
@pytest.mark.distributed
def test_zero2_reduces_every_micro_batch(counted):
    for res in counted:
        for m in MICROBATCHES:
            got = res["zero2", m]
            assert got["calls"] == {"reduce_scatter": m * len(got["buckets"])}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ddp", "zero1"])
def test_a_training_step_communicates_the_same_for_any_number_of_micro_batches(counted, layout):
    for res in counted:
        assert res[layout, "step", 4] == res[layout, "step", 1]
