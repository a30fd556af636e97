"""The rank grid: validation messages, group layout, the single-process path, and the collectives' counters."""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.parallel import Comm, ParallelConfig, ParallelDims, ParallelError, spawn


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ParallelError, match=r"multiply to 6 .* world has 4 processes"):
        ParallelDims(dp_shard=3, tp=2, world_size=4)
    with pytest.raises(ParallelError, match="positive integer"):
        ParallelDims(tp=0, world_size=1)


def test_model_must_split_evenly():
    config = preset_config("test", 64)  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ParallelError, match=r"tp=4 must divide the model's num_key_value_heads \(2\)"):
        ParallelDims(tp=4, world_size=4).validate_model(config)
    with pytest.raises(ParallelError, match="pp=3 exceeds the model's 2 layers"):
        ParallelDims(pp=3, world_size=3).validate_model(config)
    ParallelDims(tp=2, pp=2, world_size=4).validate_model(config)


def test_grid_groups_tp_innermost_pp_outermost():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=2, world_size=16, rank=11)
    assert dims.coords() == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "tp": 1}
    assert dims._groups_along(("tp",))[0] == [0, 1]
    assert dims._groups_along(("pp",))[0] == [0, 8]
    assert dims._groups_along(("dp_shard",))[0] == [0, 2]
    assert dims._groups_along(("dp_replicate",))[0] == [0, 4]
    assert dims._groups_along(("dp_replicate", "dp_shard"))[0] == [0, 2, 4, 6]


def test_single_process_axes_are_local_and_count_nothing():
    dims = ParallelDims.create()
    assert dims.world_size == 1 and dims.dp_axis.size == 1 and dims.dp_axis.group is None
    t = torch.arange(4.0)
    out = torch.empty(4)
    dims.comm.all_reduce(t, dims.dp_axis)
    dims.comm.all_gather(out, t, dims.tp_axis)
    assert torch.equal(out, t) and dims.comm.stats.total_bytes() == 0


def test_config_validation_messages():
    with pytest.raises(ParallelError, match="pick one"):
        ParallelConfig(zero=3, fsdp=True)
    with pytest.raises(ParallelError, match="--tp must be"):
        ParallelConfig(tp=0)
    assert ParallelConfig(hsdp=2).fsdp


def _collectives(rank: int, world_size: int) -> dict:
    dims = ParallelDims.create(dp_shard=2, tp=2)
    comm, stats = dims.comm, dims.comm.stats
    x = torch.full((6,), float(rank))
    comm.all_reduce(x, dims.dp_axis)
    shard = torch.empty(3)
    comm.reduce_scatter(shard, torch.arange(6.0), dims.tp_axis)
    full = torch.empty(6)
    comm.all_gather(full, shard, dims.tp_axis)
    return dict(
        reduced=x.tolist(),
        shard=shard.tolist(),
        full=full.tolist(),
        tp_ranks=dims.tp_axis.ranks,
        dp_ranks=dims.dp_axis.ranks,
        elements=dict(stats.elements),
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_collectives_and_counters_on_four_ranks():
    res = spawn(_collectives, 4, timeout_s=90)
    assert res[0]["tp_ranks"] == (0, 1) and res[0]["dp_ranks"] == (0, 2)
    assert res[1]["reduced"] == [4.0] * 6  # dp group {1, 3}
    assert res[1]["shard"] == [6.0, 8.0, 10.0] and res[0]["full"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    # ZeRO accounting: all-reduce 2Ψ, reduce-scatter Ψ (input), all-gather Ψ (output).
    assert res[0]["elements"] == {"all_reduce": 12, "reduce_scatter": 6, "all_gather": 6}


def _silent_peer(rank: int, world_size: int, done: str) -> str:
    import os
    import time

    dims = ParallelDims.create(dp_shard=2, timeout_s=2)
    comm = Comm(timeout_s=2)
    if rank == 1:  # alive but never joins the collective (a stuck or dead peer) until rank 0 has its answer
        deadline = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "skipped"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1), dims.dp_axis)
    except (RuntimeError, TimeoutError) as e:
        return f"raised after {time.monotonic() - start:.1f}s: {type(e).__name__}"
    finally:
        open(done, "w").close()
    return "returned"


@pytest.mark.slow
@pytest.mark.distributed
def test_missing_peer_times_out_instead_of_hanging(tmp_path):
    res = spawn(_silent_peer, 2, args=(str(tmp_path / "rank0-done"),), timeout_s=60)
    assert res[0].startswith("raised"), res[0]
