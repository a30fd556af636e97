"""HSDP (shard within groups of F = ``dp_shard`` ranks, replicate across ``dp_replicate`` groups): the replica
all-reduce overlaps the backward of the following unit, and the per-step volume on each mesh axis matches the formula.

* ordering, not timing: each collective and each unit's backward compute (the gradient of its ``mlp.down_proj``
  input, a matmul inside the unit) append to one log. The all-reduce of unit i is launched (async) right after its
  reduce-scatter and before the backward of unit i − 1 runs; its handle is waited only after the last unit's
  backward (the end-of-backward callback);
* volume per step and rank, Ψ = Σ padded unit sizes: on ``dp_shard`` all-gather 2Ψ (forward and backward) and
  reduce-scatter Ψ; on ``dp_replicate`` all-reduce of the shard, 2·Ψ/F (ZeRO accounting), nothing else — in
  elements and in bytes (fp32, and bf16 gathers with fp32 reduction under mixed precision).
"""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn

LAYERS, VOCAB = 4, 64


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, 8), generator=gen)
    return ids, torch.randint(0, VOCAB, (8, 8), generator=gen), torch.ones(8, 8)


def _instrument(trainer: ParallelTrainer, log: list) -> None:
    """Log every collective (op, axis, elements, bytes) at launch and every wait of an all-reduce handle."""
    comm = trainer.dims.comm

    def wrap(op: str):
        original = getattr(comm, op)

        def call(*args, **kwargs):
            tensor, axis = (args[0], args[1]) if op == "all_reduce" else (args[1], args[2])
            elements = (2 if op == "all_reduce" else 1) * tensor.numel() * (op != "all_gather" or axis.size)
            log.append((op, axis.name, elements, elements * tensor.element_size(), kwargs.get("async_op", False)))
            handle = original(*args, **kwargs)
            if op == "all_reduce":
                wait = handle.wait
                handle.wait = lambda: (log.append(("wait_all_reduce",)), wait())[-1]
            return handle

        setattr(comm, op, call)

    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        wrap(op)

    def mark(j: int):
        def hook(module, args, out) -> None:
            args[0].register_hook(lambda grad: log.append(("backward", j)))

        return hook

    for j, block in enumerate(trainer.pm.stage.layers):
        block.mlp.down_proj.register_forward_hook(mark(j))


def measure(rank: int, world_size: int) -> dict:
    out = {}
    layouts = {
        "fp32": dict(hsdp=2),
        "bf16": dict(hsdp=2, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32"),
        "fp32-cb": dict(hsdp=2, fsdp_buffer_mb=0.01),  # constant-size buffers: several collectives per unit
    }
    for name, kwargs in layouts.items():
        config = preset_config("test", VOCAB, num_hidden_layers=LAYERS)
        model = Transformer(config).init_weights(seed=0)
        trainer = ParallelTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ParallelConfig(**kwargs))
        losses = [trainer.step(*_batch())]  # warm up; then log one step
        log: list = []
        _instrument(trainer, log)
        trainer.dims.comm.stats.reset()
        losses.append(trainer.step(*_batch()))
        units = [u.padded_numel for u in trainer.pm.module.units]
        out[name] = dict(log=log, units=units, stats=dict(trainer.dims.comm.stats.elements), losses=losses)
    return out


@pytest.fixture(scope="module")
def measured():
    return spawn(measure, 4, timeout_s=240)


@pytest.mark.slow
@pytest.mark.distributed
def test_replica_all_reduce_overlaps_the_next_units_backward(measured):
    for rank_result in measured:
        log = rank_result["fp32"]["log"]
        events = [e for e in log if e[0] in ("backward", "reduce_scatter", "all_reduce", "wait_all_reduce")]
        # Backward runs blocks L-1 … 0; the root unit's gradient (embedding) completes last.
        order = [e[1] for e in events if e[0] == "backward"]
        assert order == list(range(LAYERS - 1, -1, -1))
        position = {("backward", e[1]): i for i, e in enumerate(events) if e[0] == "backward"}
        launches = [i for i, e in enumerate(events) if e[0] == "all_reduce"]
        assert len(launches) == LAYERS + 1 and all(events[i][1] == "dp_replicate" and events[i][4] for i in launches)
        for i, at in zip(range(LAYERS - 1, -1, -1), launches):
            assert events[at - 1][0] == "reduce_scatter"  # launched as soon as the unit's shard is reduced
            assert position["backward", i] < at  # after unit i's backward …
            if i > 0:
                assert at < position["backward", i - 1]  # … and before unit i-1's backward runs
        waits = [i for i, e in enumerate(events) if e[0] == "wait_all_reduce"]
        assert len(waits) == LAYERS + 1 and min(waits) > position["backward", 0]  # waited at the end of backward


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fp32", "bf16", "fp32-cb"])
def test_hsdp_volume_on_both_axes_matches_formula(measured, name):
    shard_size = 2
    for rank_result in measured:
        m = rank_result[name]
        psi = sum(m["units"])
        got: dict[tuple[str, str], list[int]] = {}
        for e in m["log"]:
            if e[0] in ("all_gather", "reduce_scatter", "all_reduce"):
                acc = got.setdefault((e[0], e[1]), [0, 0])
                acc[0] += e[2]
                acc[1] += e[3]
        gather_bytes, reduce_bytes = (2, 4) if name == "bf16" else (4, 4)
        want = {
            ("all_gather", "dp_shard"): [2 * psi, 2 * psi * gather_bytes],
            ("reduce_scatter", "dp_shard"): [psi, psi * reduce_bytes],
            ("all_reduce", "dp_replicate"): [2 * psi // shard_size, 2 * psi // shard_size * reduce_bytes],
        }
        assert got == want
        # The comm counters (per operation) agree with the per-axis log.
        assert m["stats"] == {op: elements for (op, _), (elements, _) in want.items()}


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_with_constant_buffers_trains_like_without(measured):
    for rank_result in measured:
        assert rank_result["fp32-cb"]["losses"] == rank_result["fp32"]["losses"]  # sums of two: exact
        calls = sum(1 for e in rank_result["fp32-cb"]["log"] if e[0] == "all_reduce")
        assert calls > LAYERS + 1  # each unit's shard all-reduced in pieces
