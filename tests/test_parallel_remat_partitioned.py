"""ZeRO-R partitioned activation checkpointing (Pa, Pa+cpu) on 2 spawned gloo ranks at tp = 2.

Under tensor parallelism a checkpoint's input x (B, T, C) is replicated across the TP group. Unpartitioned, the S
checkpoints of a forward hold S·X bytes on every rank (X = 4·B·T·C, fp32); partitioned, each rank keeps its
⌈B·T·C / tp⌉ elements, S·X/tp bytes, and before each recomputation one all-gather of B·T·C elements (ZeRO
accounting, :mod:`~spinwheel.parallel.comm`) rebuilds x. Measured as the bytes autograd holds after the forward of
the block stack (shared rotary cos/sin and parameters left out), and over the whole model (embedding, head and loss
included) the saving is exactly S·X·(1 − 1/tp). Losses and every rank's gradient shards equal the unpartitioned run
bit for bit, and the run without re-materialisation to fp32 rounding.

Pa+cpu keeps the slices in host memory. This machine has no GPU, so there the slice is already in host memory:
the bytes are those of Pa and the test checks only where the slices live and that the results are the same.
"""

from __future__ import annotations

import math

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import AttentionMask, Transformer, run_blocks
from spinwheel.parallel import ParallelDims, parallelize, spawn
from spinwheel.parallel.remat import SavedBytes
from spinwheel.parallel.remat_partition import PartitionedInput
from spinwheel.parallel.tensor import vocab_parallel_cross_entropy

TP, VOCAB, B, T, L = 2, 64, 3, 10, 4
C = preset_config("test", VOCAB).hidden_size
X = 4 * B * T * C
RUNS = [
    ("none", None, "none"),
    ("block", None, "none"),
    ("block", None, "tp"),
    ("block", None, "tp-cpu"),
    ("every-k", None, "none"),
    ("every-k", None, "tp"),
    ("every-k", 3, "tp-cpu"),
]


def one_run(dims: ParallelDims, mode: str, k: int | None, partition: str) -> dict:
    model = Transformer(preset_config("test", VOCAB, num_hidden_layers=L)).init_weights(seed=1)
    pm = parallelize(model, dims, remat=mode, remat_k=k, remat_partition=partition)
    stage, comm, axis = pm.stage, dims.comm, dims.tp_axis
    params = list(stage.parameters())
    gen = torch.Generator().manual_seed(3)  # the same replicated input on both TP ranks
    h = torch.randn(B, T, C, generator=gen, requires_grad=True)
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=gen)
    positions = torch.arange(T).expand(B, T)
    cos, sin = stage.rotary(positions, torch.float32)
    with SavedBytes(exclude=params) as blocks:
        out = run_blocks(stage.layers, stage.rotary, h, positions, AttentionMask(None))
    cos_sin = sum(t.untyped_storage().nbytes() for t in (cos, sin))
    out.sum().backward()
    stage.zero_grad()
    comm.stats.reset()
    with SavedBytes(exclude=params) as whole:
        logits = pm.module(ids[:, :-1])  # (B, T, V/tp)
        loss = vocab_parallel_cross_entropy(logits, ids[:, 1:], axis, comm).mean()
    forward_gathers = comm.stats.calls.get("all_gather", 0)
    loss.backward()
    return {
        "blocks": blocks.nbytes - cos_sin,
        "whole": whole.nbytes,
        "loss": loss.item(),
        "grads": {n: p.grad.numpy().copy() for n, p in stage.named_parameters()},  # tensors would go by fd
        "gathers": comm.stats.calls.get("all_gather", 0) - forward_gathers,
        "gathered": comm.stats.elements.get("all_gather", 0),
        "blocks_in_host_memory": blocks.bytes_on("cpu") - cos_sin,
    }


def worker(rank: int, world_size: int) -> dict:
    dims = ParallelDims.create(tp=TP)
    results = {run: one_run(dims, *run) for run in RUNS}
    # An input whose size the group does not divide: padded slices, the same tensor after the all-gather.
    store = PartitionedInput(dims.tp_axis, dims.comm)
    odd = torch.arange(7.0).view(7, 1)
    part, meta = store.pack(odd)
    results["odd"] = (part.numel(), torch.equal(store.unpack(part, meta), odd))
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return spawn(worker, TP, timeout_s=240)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", [r for r in RUNS if r[0] != "none"])
def test_partitioned_checkpoints_hold_one_over_tp(per_rank, run):
    mode, k, partition = run
    segments = L if mode == "block" else math.ceil(L / (k or round(math.sqrt(L))))
    whole_run = (mode, k, "none") if (mode, k, "none") in RUNS else (mode, None, "none")
    for res in per_rank:
        got, unpartitioned = res[run], res[whole_run]
        expected = segments * X // (TP if partition != "none" else 1)
        assert got["blocks"] == expected, (run, got["blocks"], expected)
        if partition != "none" and whole_run[1] == k:
            assert unpartitioned["whole"] - got["whole"] == segments * X * (TP - 1) // TP
            # Pa's price: one all-gather of each checkpoint's B·T·C elements before its recomputation.
            assert got["gathers"] - unpartitioned["gathers"] == segments
            assert got["gathered"] - unpartitioned["gathered"] == segments * B * T * C


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", [r for r in RUNS if r[0] != "none"])
def test_losses_and_gradients_equal_the_unpartitioned_run(per_rank, run):
    mode, k, partition = run
    for res in per_rank:
        got, plain = res[run], res[("none", None, "none")]
        assert got["loss"] == pytest.approx(plain["loss"], rel=1e-7)
        for name, g in plain["grads"].items():
            torch.testing.assert_close(
                torch.from_numpy(got["grads"][name]), torch.from_numpy(g), rtol=1e-6, atol=1e-9, msg=f"{run} {name}"
            )
        same_k = (mode, k, "none")
        if partition != "none" and same_k in RUNS:
            assert got["loss"] == res[same_k]["loss"]
            for name, g in res[same_k]["grads"].items():
                assert (got["grads"][name] == g).all(), (run, name)


@pytest.mark.slow
@pytest.mark.distributed
def test_pa_cpu_keeps_the_slices_in_host_memory_and_padding_round_trips(per_rank):
    for res in per_rank:
        for run in RUNS:
            if run[2] == "tp-cpu":
                assert res[run]["blocks_in_host_memory"] == res[run]["blocks"] > 0
        assert res["odd"] == (4, True)  # ⌈7 / 2⌉ elements per rank


M, ROWS = 2, 2  # pipeline micro-batches, rows per micro-batch


def pipeline_worker(rank: int, world_size: int) -> dict:
    """GPipe's stage mode on a tp 2 × pp 2 grid, checkpoints whole and partitioned: peak bytes held, loss, grads."""
    dims = ParallelDims.create(tp=TP, pp=2)
    out = {"stage": dims.pp_axis.rank}
    for partition in ("none", "tp"):
        model = Transformer(preset_config("test", VOCAB, num_hidden_layers=L)).init_weights(seed=1)
        pm = parallelize(model, dims, remat="stage", remat_partition=partition, schedule="gpipe")
        pm.pipeline.track_activations = True
        ids = torch.randint(0, VOCAB, (M * ROWS, T + 1), generator=torch.Generator().manual_seed(5))
        inputs, labels = [mb[:, :-1].clone() for mb in ids.chunk(M)], [mb[:, 1:] for mb in ids.chunk(M)]

        def loss_fn(logits: torch.Tensor, i: int, labels: list[torch.Tensor] = labels) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits, labels[i], dims.tp_axis, dims.comm).mean() / M

        loss = pm.pipeline.step(inputs, loss_fn, module=pm.module)
        out[partition] = {
            "peak": pm.pipeline.stats.peak_activation_bytes,
            "loss": float(loss),
            "grads": {n: p.grad.numpy().copy() for n, p in pm.stage.named_parameters()},
        }
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_stage_mode_partitioned_under_tp_and_pp():
    """Stage 1 keeps M received inputs of X₁ = 4·b·T·C bytes each, whole; partitioned, M·X₁/tp (the schedule frees
    the received tensor's storage; it needs only its shape for the gradient). Stage 0's input is token ids, kept
    whole (8·b·T bytes each). Losses and gradients are the same bit for bit."""
    for res in spawn(pipeline_worker, 4, timeout_s=240):
        whole, part = res["none"], res["tp"]
        if res["stage"] == 0:
            assert whole["peak"] == part["peak"] == M * 8 * ROWS * T
        else:
            assert whole["peak"] == M * 4 * ROWS * T * C
            assert part["peak"] == whole["peak"] // TP
            assert part["loss"] == whole["loss"] and whole["loss"] > 0
        for name, g in whole["grads"].items():
            assert (part["grads"][name] == g).all(), name
