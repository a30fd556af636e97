"""Constant-size buffers (CB) and contiguous gradients (MD) for FSDP / ZeRO-3 (ZeRO-R, the ZeRO paper §6).

* every all-gather and reduce-scatter moves at most B = ``--fsdp-buffer-mb`` bytes; a unit of shard size s is
  ⌈s / n⌉ collectives with n = B / (N · element size), counted per step;
* the staging is the same size for a model twice as wide, allocated once: the ring's storages and the number of
  staging tensors ever created do not change across steps (without CB, casts allocate temporaries every step);
* every unit's reduced shard gradient is a view of one contiguous buffer, the same storage every step;
* losses and final parameters equal the run without CB (and, in composed 4-rank layouts, single-process
  training: test_parallel_fidelity's CB layouts).
"""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.data.buffers import NUM_SLOTS

VOCAB, STEPS, BUFFER_MB = 64, 3, 0.01
BUFFER_BYTES = int(BUFFER_MB * 2**20)


def _batches():
    gen = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(0, VOCAB, (8, 8), generator=gen),
            torch.randint(0, VOCAB, (8, 8), generator=gen),
            (torch.rand(8, 8, generator=gen) > 0.3).float(),
        )
        for _ in range(STEPS)
    ]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def train(kwargs: dict, hidden: int = 32) -> dict:
    config = preset_config("test", VOCAB, num_hidden_layers=3, hidden_size=hidden, intermediate_size=2 * hidden)
    model = Transformer(config).init_weights(seed=0)
    trainer = ParallelTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ParallelConfig(**kwargs))
    fsdp, stats = trainer.pm.module, trainer.dims.comm.stats
    sizes: list[tuple[str, int]] = []  # bytes each collective moves (the full-size side)
    comm = trainer.dims.comm
    for op in ("all_gather", "reduce_scatter"):
        original = getattr(comm, op)

        def call(output, input, axis, *args, _op=op, _original=original, **kwargs):
            big = output if _op == "all_gather" else input
            sizes.append((_op, big.numel() * big.element_size()))
            return _original(output, input, axis, *args, **kwargs)

        setattr(comm, op, call)
    losses, snapshots = [], []
    for b in _batches():
        stats.reset()
        sizes.clear()
        losses.append(trainer.forward_backward(*b))
        trainer.optimizer.step()
        rings = fsdp.buffers.rings.values()
        snapshots.append(
            dict(
                allocations=fsdp.buffers.allocations,
                staging=sorted(_storage(t) for r in rings for t in r.small + r.large),
                calls=dict(stats.calls),
                sizes=list(sizes),
            )
        )
        # MD: before zero_grad of the next step, every shard gradient is a view of the one gradient buffer.
        snapshots[-1]["grads"] = [(_storage(u.shard.grad), u.shard.grad.data_ptr()) for u in fsdp.units]
        trainer.optimizer.zero_grad()
    return dict(
        losses=losses,
        params={k: v.tolist() for k, v in trainer.full_state_dict().items()},
        steps=snapshots,
        grad_storage=_storage(fsdp.grads.flat),
        shards=[u.shard_size for u in fsdp.units],
        gather_piece=fsdp.buffers.piece_numel(fsdp.buffers.gather_dtype) if fsdp.buffers.buffer_bytes else None,
        staging_bytes=fsdp.buffers.staging_bytes(),
    )


LAYOUTS = {
    "fsdp": dict(fsdp=True),
    "zero3": dict(zero=3),
    "fsdp-bf16": dict(fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32"),
}


def run(rank: int, world_size: int) -> dict:
    out = {}
    for name, kwargs in LAYOUTS.items():
        out[name, "off"] = train(kwargs)
        out[name, "cb"] = train({**kwargs, "fsdp_buffer_mb": BUFFER_MB})
    out["wide", "cb"] = train({"fsdp": True, "fsdp_buffer_mb": BUFFER_MB}, hidden=64)
    out["zero2-grads"] = zero2_grads(rank, world_size)  # the same world: one spawn for the module
    return out


@pytest.fixture(scope="module")
def measured():
    return spawn(run, 2, timeout_s=240)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cb_losses_equal_the_run_without(measured, name):
    for res in measured:
        off, cb = res[name, "off"], res[name, "cb"]
        assert cb["losses"] == off["losses"]  # two ranks: every element's sum is the same a + b
        assert cb["params"] == off["params"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cb_collectives_fit_the_buffer_and_count(measured, name):
    for res in measured:
        cb = res[name, "cb"]
        gather_bytes = 2 if name.endswith("bf16") else 4
        n_gather = BUFFER_BYTES // (2 * gather_bytes)  # elements per rank in one gather piece
        n_reduce = BUFFER_BYTES // (2 * 4)
        pieces = [-(-s // n_gather) for s in cb["shards"]]
        assert cb["gather_piece"] == n_gather
        want = {"all_gather": 2 * sum(pieces), "reduce_scatter": sum(-(-s // n_reduce) for s in cb["shards"])}
        assert max(pieces) > 1  # the buffer really splits the units
        for step in cb["steps"]:
            assert step["calls"] == want
            assert max(size for _, size in step["sizes"]) <= BUFFER_BYTES
        off = res[name, "off"]["steps"][-1]["calls"]
        assert off == {"all_gather": 2 * len(cb["shards"]), "reduce_scatter": len(cb["shards"])}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cb_buffers_are_constant_and_reused(measured, name):
    for res in measured:
        cb, off = res[name, "cb"], res[name, "off"]

        # Two rings (gather, reduce) of NUM_SLOTS slots, each a large (N·n ≤ B bytes) and a small (n) tensor.
        def ring(element: int) -> int:
            n = BUFFER_BYTES // (2 * element)
            return NUM_SLOTS * (2 * n + n) * element

        assert cb["staging_bytes"] == ring(2 if name.endswith("bf16") else 4) + ring(4)
        assert res["wide", "cb"]["staging_bytes"] == 2 * ring(4)  # independent of the model's size
        assert res["wide", "cb"]["shards"][0] > 2 * cb["shards"][0]
        first = cb["steps"][0]
        for step in cb["steps"]:
            assert step["allocations"] == first["allocations"] == 4 * NUM_SLOTS  # allocated once, at construction
            assert step["staging"] == first["staging"]  # the same storages every step
        if name.endswith("bf16"):  # without CB the casts allocate temporaries, more every step
            counts = [s["allocations"] for s in off["steps"]]
            assert counts[0] > 0 and counts[1] - counts[0] == counts[2] - counts[1] > 0
        for run in (cb, off):  # MD: one contiguous gradient buffer, reused
            for step in run["steps"]:
                assert {storage for storage, _ in step["grads"]} == {run["grad_storage"]}
                assert step["grads"] == run["steps"][0]["grads"]


def test_pieces_cover_the_shard_in_buffer_sized_ranges():
    from spinwheel.parallel.comm import Comm
    from spinwheel.parallel.data.buffers import CommBuffers
    from spinwheel.parallel.mesh import Axis

    axis = Axis("dp_shard", (0, 1, 2, 3), 0)  # only sizes are read: no process group needed
    buffers = CommBuffers(axis, Comm(), torch.bfloat16, torch.float32, torch.device("cpu"), buffer_mb=1.0)
    assert buffers.piece_numel(torch.bfloat16) == 2**20 // (4 * 2) and buffers.piece_numel(torch.float32) == 2**16
    assert buffers.pieces(150_000, torch.float32) == [(0, 65536), (65536, 131072), (131072, 150_000)]
    assert buffers.staging_bytes() == NUM_SLOTS * (2**20 + 2**18) * 2  # two rings: large B + small B/N each
    off = CommBuffers(axis, Comm(), torch.float32, torch.float32, torch.device("cpu"))
    assert off.pieces(150_000, torch.float32) == [(0, 150_000)] and off.staging_bytes() == 0


def test_buffer_and_precision_options_need_a_fully_sharded_layout():
    from spinwheel.parallel.mesh import ParallelError

    with pytest.raises(ParallelError, match="--fsdp-buffer-mb applies to fully sharded"):
        ParallelConfig(zero=2, fsdp_buffer_mb=1.0)
    with pytest.raises(ParallelError, match="--fsdp-param-dtype"):
        ParallelConfig(fsdp_param_dtype="bf16")
    policy = ParallelConfig(zero=3, fsdp_param_dtype="bf16").mixed_precision()
    assert policy.compute_dtype(torch.float32) == policy.comm_dtype(torch.float32) == torch.bfloat16
    assert ParallelConfig(fsdp=True).mixed_precision() is None


def zero2_grads(rank: int, world_size: int) -> list[list[tuple[int, int]]]:
    config = preset_config("test", VOCAB, num_hidden_layers=3)
    trainer = ParallelTrainer(
        Transformer(config).init_weights(seed=0),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        ParallelConfig(zero=2, bucket_mb=0.01),
    )
    module, out = trainer.pm.module, []
    for b in _batches():
        trainer.forward_backward(*b)
        trainer.optimizer.step()
        out.append([(_storage(bk.shard_grad), bk.shard_grad.data_ptr()) for bk in module.buckets])
        out[-1].append((_storage(module.grads.flat), len(module.buckets)))
        trainer.optimizer.zero_grad()
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_zero2_reduced_gradients_live_in_one_contiguous_buffer(measured):
    for steps in (res["zero2-grads"] for res in measured):
        *views, (flat, num_buckets) = steps[0]
        assert num_buckets > 1 and {storage for storage, _ in views} == {flat}
        assert all(step == steps[0] for step in steps)  # the same views every step
