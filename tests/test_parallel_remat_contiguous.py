"""Checkpoints in one contiguous buffer (``--remat-contiguous``, ZeRO-R's memory defragmentation for activations).

Notation as in test_parallel_remat_modes: L blocks, micro-batches of B rows × T tokens, hidden size C, fp32. A block
input is X = 4·B·T·C bytes, a multiple of the buffer's 16-byte slot alignment, so the buffer holds exactly the sum
of the bytes its checkpoints keep at once:

* ``block``: L·X;  ``every-k``: ⌈L/k⌉·X;  with Pa at tp = 2, each rank keeps slices: S·4·⌈B·T·C / tp⌉;
* ``stage`` (K = 2 pipeline stages, micro-batches of b rows): m·8·b·T bytes of token ids on stage 0 and m·4·b·T·C
  of hidden states on stage 1, m the micro-batches in flight (M under GPipe, K − s under 1F1B).

Each run trains a few SGD steps beside the same run without the buffer. Shown: the kept checkpoint tensors of every
step after the first are views of one storage, the same one across steps; the first step allocates each checkpoint
on its own and every later step allocates nothing; the buffer's size is the formula; losses and gradients equal the
run without the buffer bit for bit (the buffer holds copies of the same values).
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F

from spinwheel.cli import build_parser
from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelDims, ParallelTrainer, parallelize, spawn
from spinwheel.parallel.remat import SavedBytes, apply_remat
from spinwheel.parallel.remat_buffer import CheckpointBuffer
from spinwheel.parallel.remat_partition import WholeInput
from spinwheel.parallel.remat_region import CheckpointRegion
from spinwheel.parallel.tensor import vocab_parallel_cross_entropy
from spinwheel.train.resume import check_resume
from spinwheel.train.sft.sft import RESUME_HARMLESS

VOCAB, B, T, L, LR, STEPS = 64, 3, 10, 6, 0.1, 3
CONFIG = preset_config("test", VOCAB, num_hidden_layers=L)
C = CONFIG.hidden_size
X = 4 * B * T * C


def batch(step: int, rows: int = B, tokens: int = T) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, tokens + 1), generator=torch.Generator().manual_seed(10 + step))


def sgd(params) -> None:
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad
            p.grad = None


class Recording:
    """A store that notes the storage of every tensor the inner store keeps (pointers only: no lifetime change)."""

    def __init__(self, inner: WholeInput) -> None:
        self.inner, self.kept = inner, []
        self.copies_input = inner.copies_input

    def pack(self, x: torch.Tensor):
        kept, meta = self.inner.pack(x)
        self.kept.append(kept.untyped_storage().data_ptr())
        return kept, meta

    def unpack(self, saved: torch.Tensor, meta):
        return self.inner.unpack(saved, meta)


def test_buffer_sizes_itself_at_the_first_quiescent_point_and_grows_with_a_reason():
    buf, cpu = CheckpointBuffer(), torch.device("cpu")
    slots = [buf.keep(torch.full((2, 4), float(i))) for i in range(3)] + [buf.allocate((3,), torch.int64, cpu)]
    assert buf.num_allocations == 4 and buf.capacity == 0 and buf.live_bytes == 3 * 32 + 32  # 24 B aligned to 32
    del slots
    assert buf.live_bytes == 0 and buf.capacity == 128 and buf.num_allocations == 5
    assert buf.growths == ["sized at 128 bytes: the most the first step's checkpoints held at once"]
    ptr = buf.storage.untyped_storage().data_ptr()
    a, b, c = (buf.keep(torch.full((2, 4), float(i))) for i in range(3))
    assert [s.offset for s in (a, b, c)] == [0, 32, 64] and buf.num_allocations == 5
    assert all(s.tensor.untyped_storage().data_ptr() == ptr for s in (a, b, c))
    assert torch.equal(b.tensor, torch.full((2, 4), 1.0))
    del a, b  # neighbouring holes merge: a slot of both their sizes fits at offset 0
    d = buf.allocate((16,), torch.float32, cpu)
    assert d.offset == 0 and torch.equal(c.tensor, torch.full((2, 4), 2.0))
    e = buf.allocate((16,), torch.float32, cpu)  # 64 B with one 32 B hole left: an overflow allocation
    assert e.offset is None and buf.num_allocations == 6
    del c, d, e  # 160 B were live at once, but the hole could not take e: the buffer grows by all of e
    assert buf.capacity == 192 and buf.num_allocations == 7
    assert buf.growths[1].startswith(
        "grown from 128 to 192 bytes: a later step's checkpoints held 160 bytes at once, 64"
    )
    with pytest.raises(ValueError, match="lives on one device"):
        buf.allocate((1,), torch.float32, torch.device("meta"))


def train(mode: str, k: int | None, contiguous: bool, tokens: tuple[int, ...] = (T,) * STEPS) -> list[dict]:
    """SGD steps of the L-block model, checkpoints kept by a recording store (over a buffer with ``contiguous``)."""
    model = Transformer(CONFIG).init_weights(seed=1)
    buf = CheckpointBuffer() if contiguous else None
    store = Recording(WholeInput(buf))
    apply_remat(model, mode, k, store)
    steps = []
    for step, t in enumerate(tokens):
        store.kept.clear()
        before = buf.num_allocations if buf else 0
        ids = batch(step, tokens=t)
        with SavedBytes(exclude=model.parameters()) as saved:
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        sgd(model.parameters())
        steps.append(
            {
                "loss": loss.item(),
                "grads": grads,
                "kept": list(store.kept),
                "storages": dict(saved.storages),
                "allocations": (buf.num_allocations - before) if buf else None,
                "buffer": buf.storage.untyped_storage().data_ptr() if buf and buf.storage is not None else None,
                "capacity": buf.capacity if buf else None,
                "live_after_backward": buf.live_bytes if buf else None,
            }
        )
    return steps


@pytest.mark.parametrize("mode,k,checkpoints", [("block", None, L), ("every-k", None, 3), ("every-k", 4, 2)])
def test_checkpoints_share_one_storage_allocated_once(mode, k, checkpoints):
    plain, contiguous = train(mode, k, False), train(mode, k, True)
    first, later = contiguous[0], contiguous[1:]
    assert len(set(first["kept"])) == checkpoints == first["allocations"] - 1  # each its own, then the buffer
    assert first["capacity"] == checkpoints * X  # the formula, from the first step's shapes
    for step in later:
        assert step["kept"] == [step["buffer"]] * checkpoints and step["buffer"] == first["buffer"]
        assert step["allocations"] == 0 and step["capacity"] == checkpoints * X
        assert step["storages"][step["buffer"]] == checkpoints * X
    for a, b in zip(plain, contiguous):
        assert b["live_after_backward"] == 0
        # The same bytes held for backward, in checkpoints − 1 fewer storages.
        assert sum(b["storages"].values()) == sum(a["storages"].values())
        assert len(a["storages"]) - len(b["storages"]) == (checkpoints - 1 if b is not first else 0)
        assert a["loss"] == b["loss"]
        for name, g in a["grads"].items():
            assert torch.equal(b["grads"][name], g), name


def test_longer_sequences_grow_the_buffer_once():
    tokens = (T, T, 2 * T, 2 * T, T)
    plain, contiguous = train("block", None, False, tokens), train("block", None, True, tokens)
    # At 2T the L·X buffer takes L/2 of the 2X checkpoints; the other L/2 overflow, then the buffer grows to 2·L·X.
    assert [s["allocations"] for s in contiguous] == [L + 1, 0, L // 2 + 1, 0, 0]
    assert [s["capacity"] for s in contiguous] == [L * X, L * X, 2 * L * X, 2 * L * X, 2 * L * X]
    assert contiguous[2]["buffer"] != contiguous[1]["buffer"] == contiguous[0]["buffer"]
    assert [a["loss"] for a in plain] == [b["loss"] for b in contiguous]


def test_a_retained_graph_keeps_its_slots_until_the_last_backward():
    grads = {}
    for contiguous in (False, True):
        model = Transformer(CONFIG).init_weights(seed=1)
        buf = CheckpointBuffer()
        apply_remat(model, "every-k", None, WholeInput(buf if contiguous else None))
        ids = batch(0)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward(retain_graph=True)
        assert buf.live_bytes == (3 * X if contiguous else 0)  # the second backward recomputes from them
        loss.backward()
        assert buf.live_bytes == 0
        grads[contiguous] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads[False].items():
        assert torch.equal(grads[True][name], g), name


@pytest.mark.slow
def test_regions_are_freed_with_their_graph_not_by_the_cycle_collector():
    """What a slot's release (and any checkpoint's memory) relies on: once backward has run, no region survives,
    even with Python's cyclic garbage collector off."""
    model = Transformer(CONFIG).init_weights(seed=1)
    apply_remat(model, "block")
    gc.collect()
    gc.disable()
    try:
        for step in range(2):
            ids = batch(step)
            F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
            assert not [o for o in gc.get_objects() if isinstance(o, CheckpointRegion)], step
    finally:
        gc.enable()


def test_trainer_option_equals_the_run_without_it():
    runs = {}
    for contiguous in (False, True):
        config = ParallelConfig(remat="every-k", remat_k=4, remat_contiguous=contiguous)
        trainer = ParallelTrainer(
            Transformer(CONFIG).init_weights(seed=1), lambda ps: torch.optim.SGD(ps, lr=LR), config
        )
        buf = trainer.pm.remat_buffer
        assert (buf is not None) == contiguous
        losses, allocations = [], []
        for step in range(STEPS):
            ids = batch(step)
            losses.append(trainer.step(ids[:, :-1], ids[:, 1:], torch.ones(B, T)))
            allocations.append(buf.num_allocations if buf else 0)
        runs[contiguous] = losses, allocations, buf.capacity if buf else 0
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == [2 + 1] * STEPS and runs[True][2] == 2 * X  # ⌈6 / 4⌉ checkpoints, then nothing


def test_option_is_checked_and_spelled():
    with pytest.raises(ValueError, match="--remat-contiguous keeps checkpoints in one buffer: choose a --remat mode"):
        ParallelConfig(remat_contiguous=True)
    assert ParallelConfig(remat="block", remat_contiguous=True).remat_contiguous
    assert build_parser().parse_args(["sft", "--remat", "--remat-contiguous"]).remat_contiguous
    assert not build_parser().parse_args(["sft", "--remat"]).remat_contiguous
    # The buffer holds copies of the same values: a run may resume with it switched on or off.
    stored, new = {"parallel": {"remat_contiguous": False}}, {"parallel": {"remat_contiguous": True}}
    changes = check_resume(stored, new, RESUME_HARMLESS, force=False, where="ckpt")
    assert [c.key for c in changes] == ["parallel.remat_contiguous"]


TP, PA_STEPS = 2, 3
PA_RUNS = [("block", None, "tp"), ("every-k", None, "tp-cpu"), ("every-k", 3, "tp")]


def pa_run(dims: ParallelDims, mode: str, k: int | None, partition: str, contiguous: bool) -> list[dict]:
    model = Transformer(preset_config("test", VOCAB, num_hidden_layers=4)).init_weights(seed=1)
    pm = parallelize(model, dims, remat=mode, remat_k=k, remat_partition=partition, remat_contiguous=contiguous)
    buf, params = pm.remat_buffer, list(pm.stage.parameters())
    steps = []
    for step in range(PA_STEPS):
        ids = batch(step)  # the same on both TP ranks
        before = buf.num_allocations if buf else 0
        with SavedBytes(exclude=params) as saved:
            logits = pm.module(ids[:, :-1])  # (B, T, V/tp)
            loss = vocab_parallel_cross_entropy(logits, ids[:, 1:], dims.tp_axis, dims.comm).mean()
        loss.backward()
        steps.append(
            {
                "loss": loss.item(),
                "grads": {n: p.grad.numpy().copy() for n, p in pm.stage.named_parameters()},
                "storages": dict(saved.storages),
                "allocations": (buf.num_allocations - before) if buf else None,
                "buffer": buf.storage.untyped_storage().data_ptr() if buf else None,
                "capacity": buf.capacity if buf else None,
            }
        )
        sgd(params)
    return steps


def pa_worker(rank: int, world_size: int) -> dict:
    dims = ParallelDims.create(tp=TP)
    return {(run, c): pa_run(dims, *run, c) for run in PA_RUNS for c in (False, True)}


@pytest.mark.slow
@pytest.mark.distributed
def test_partitioned_checkpoints_in_one_buffer(two_ranks):
    """Pa and Pa+cpu: the buffer holds each rank's slices, S·4·⌈B·T·C / 2⌉ bytes (S = 4 or ⌈4/k⌉ checkpoints)."""
    for res in (r["pa"] for r in two_ranks):
        for mode, k, partition in PA_RUNS:
            plain, contiguous = res[(mode, k, partition), False], res[(mode, k, partition), True]
            checkpoints = 4 if mode == "block" else math.ceil(4 / (k or 2))
            size = checkpoints * 4 * -(-B * T * C // TP)
            assert contiguous[0]["allocations"] == checkpoints + 1
            for step in contiguous[1:]:
                assert step["allocations"] == 0 and step["buffer"] == contiguous[0]["buffer"]
                assert step["capacity"] == size and step["storages"][step["buffer"]] == size
            for a, b in zip(plain, contiguous):
                assert sum(a["storages"].values()) == sum(b["storages"].values())
                assert a["loss"] == b["loss"]
                for name, g in a["grads"].items():
                    assert (b["grads"][name] == g).all(), (mode, k, partition, name)


M, ROWS = 4, 2  # pipeline micro-batches, rows per micro-batch


def stage_worker(rank: int, world_size: int) -> dict:
    """GPipe's stage mode on 2 stages, both schedules, with and without the buffer: two SGD steps each."""
    dims = ParallelDims.create(pp=2)
    out = {"stage": dims.pp_axis.rank}
    for schedule in ("gpipe", "1f1b"):
        for contiguous in (False, True):
            model = Transformer(preset_config("test", VOCAB, num_hidden_layers=4)).init_weights(seed=1)
            pm = parallelize(model, dims, remat="stage", schedule=schedule, remat_contiguous=contiguous)
            buf, steps = pm.remat_buffer, []
            for step in range(2):
                ids = batch(step, rows=M * ROWS)
                inputs, labels = [mb[:, :-1].clone() for mb in ids.chunk(M)], [mb[:, 1:] for mb in ids.chunk(M)]

                def loss_fn(logits: torch.Tensor, i: int, labels: list[torch.Tensor] = labels) -> torch.Tensor:
                    return F.cross_entropy(logits.flatten(0, 1), labels[i].flatten()) / M

                loss = pm.pipeline.step(inputs, loss_fn, module=pm.module)
                grads = {n: p.grad.numpy().copy() for n, p in pm.stage.named_parameters()}
                sgd(pm.stage.parameters())
                steps.append((float(loss), grads, buf.num_allocations if buf else 0, buf.capacity if buf else 0))
            out[schedule, contiguous] = steps
    return out


def both_workers(rank: int, world_size: int) -> dict:
    return {"pa": pa_worker(rank, world_size), "stage": stage_worker(rank, world_size)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The Pa runs (tp 2) and the stage-mode runs (pp 2) in one spawned world of TP = 2 ranks."""
    return spawn(both_workers, TP, timeout_s=360)


@pytest.mark.slow
@pytest.mark.distributed
def test_stage_mode_buffer_holds_the_inputs_in_flight(two_ranks):
    for res in (r["stage"] for r in two_ranks):
        s = res["stage"]
        input_bytes = 8 * ROWS * T if s == 0 else 4 * ROWS * T * C  # token ids (int64) / hidden states (fp32)
        for schedule, in_flight in (("gpipe", M), ("1f1b", 2 - s)):
            plain, contiguous = res[schedule, False], res[schedule, True]
            # Each micro-batch of the first step has its own checkpoint until nothing is in flight: the step's end,
            # or, with one micro-batch in flight (1F1B's last stage), the first micro-batch's backward.
            first = M if in_flight > 1 else 1
            assert [(n, cap) for *_, n, cap in contiguous] == [(first + 1, in_flight * input_bytes)] * 2, (s, schedule)
            for (loss_a, grads_a, *_), (loss_b, grads_b, *_) in zip(plain, contiguous):
                assert loss_a == loss_b
                for name, g in grads_a.items():
                    assert (grads_b[name] == g).all(), (s, schedule, name)
