"""Communication overlapped with compute, asserted as an order of events (not as timings), on 2 spawned gloo ranks.

* **DDP** (Li et al., 2020, §3.2.2): a bucket's all-reduce is launched (async) from the post-accumulate-grad hook that
  fills it, while the earlier layers still run backward — every bucket but the one holding the last gradient (the
  embedding's) is launched before that gradient is ready; the handles are waited only at the end of backward.
* **DDP, unused parameters** (§3.2.3, "globally unused parameters"): a branch only rank 0 runs gives rank 1 no
  gradient for its parameters; their bucket is zero-filled at the end of backward and all-reduced, so the ranks
  launch the same collectives and never hang, and every gradient equals the single-process one of the global
  batch.
* **FSDP prefetch** (Zhao et al., 2023, §3.3, backward and forward prefetching): the all-gather of the next unit
  is issued (async) before the current unit's compute finishes — in forward unit i + 1 before block i's MLP has
  run, in backward unit i − 1 before block i's attention backward has run.

Each event is appended to one log: parameters' gradients ready (hooks registered before the wrapper's, so they run
first), collectives launched and waited (the :class:`~spinwheel.parallel.comm.Comm` methods wrapped), FSDP gathers
issued (each unit's ``unshard`` wrapped) and the compute inside a block (module and tensor hooks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelDims, parallelize, spawn
from spinwheel.parallel.comm import Comm
from spinwheel.parallel.data.ddp import DistributedDataParallel
from spinwheel.parallel.data.flat_param import UnitState

LAYERS, VOCAB, B, T = 4, 64, 2, 8
UNUSED_TIMEOUT_S = 10  # a collective that waits longer fails the unused-parameter test instead of hanging it


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randint(0, VOCAB, (B, T), generator=gen), torch.randint(0, VOCAB, (B, T), generator=gen)


def _loss(module: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(module(ids).flatten(0, 1), labels.flatten())


def _log_all_reduce(comm: Comm, log: list) -> None:
    """Log each all-reduce at launch (with its async flag) and each wait of its handle."""
    original = comm.all_reduce

    def call(tensor, axis, *args, **kwargs):
        log.append(("launch", kwargs.get("async_op", False)))
        handle = original(tensor, axis, *args, **kwargs)
        wait = handle.wait
        handle.wait = lambda: (log.append(("wait",)), wait())[-1]
        return handle

    comm.all_reduce = call


def _compact(log: list) -> str:
    """The DDP log in one line: R a gradient ready, L a launch, W a wait."""
    return "".join({"ready": "R", "launch": "L", "wait": "W"}[e[0]] for e in log)


def ddp_overlap(dims: ParallelDims) -> dict:
    model = Transformer(preset_config("test", VOCAB, num_hidden_layers=LAYERS)).init_weights(seed=0)
    log: list = []
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():  # registered before DDP's hooks: logged before DDP may launch a bucket
        p.register_post_accumulate_grad_hook(lambda p: log.append(("ready", names[id(p)])))
    pm = parallelize(model, dims, bucket_mb=0.01)  # ~ one bucket per weight matrix
    _log_all_reduce(dims.comm, log)
    _loss(pm.module, *_batch(dims.rank)).backward()
    del dims.comm.all_reduce  # the class's method again
    buckets = [[names[id(p)] for p in b.params] for b in pm.module._buckets]
    return {"log": log, "buckets": buckets}


class _Branchy(nn.Module):
    """Two linear layers and a branch that only ranks asked to use it run (its parameters get no gradient elsewhere)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.first, self.branch, self.last = (nn.Linear(6, 6) for _ in range(3))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.last(h).square().mean()


def _branch_data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def ddp_unused(dims: ParallelDims) -> list[dict[str, torch.Tensor]]:
    """Two backwards (the buckets' bookkeeping must reset); rank 0 runs the branch, rank 1 does not."""
    model = _Branchy()
    comm = Comm(timeout_s=UNUSED_TIMEOUT_S)
    ddp = DistributedDataParallel(model, dims.dp_axis, comm, bucket_mb=0.0001)  # one bucket per parameter
    grads = []
    for step in range(2):
        ddp(_branch_data(dims.rank, step), use_branch=dims.rank == 0).backward()
        grads.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})  # tensors would go by fd
        model.zero_grad()
    return grads


def branch_reference(world: int) -> list[dict[str, torch.Tensor]]:
    """One process: the mean over ranks of each rank's loss (the branch on rank 0 only)."""
    model = _Branchy()
    grads = []
    for step in range(2):
        loss = sum(model(_branch_data(r, step), use_branch=r == 0) for r in range(world)) / world
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    return grads


def _mark(log: list, event: tuple):
    return lambda *args: log.append(event)


def _mark_grad(log: list, event: tuple):
    """A forward pre-hook that logs ``event`` when the gradient of the module's first input is computed."""

    def hook(module, args) -> None:
        args[0].register_hook(_mark(log, event))

    return hook


def fsdp_prefetch(dims: ParallelDims) -> list:
    model = Transformer(preset_config("test", VOCAB, num_hidden_layers=LAYERS)).init_weights(seed=0)
    pm = parallelize(model, dims, fsdp=True)
    log: list = []
    for i, unit in enumerate(pm.module.units):

        def unshard(buffers, async_op=False, unit=unit, original=unit.unshard, i=i):
            if unit.state is UnitState.SHARDED:
                log.append(("gather", i, async_op))
            return original(buffers, async_op)

        unit.unshard = unshard
    for j, block in enumerate(pm.stage.layers):
        # Forward compute of block j runs from its attention's first call to its MLP's return; its backward runs
        # the MLP's backward (the gradient of down_proj's input) first and ends with the attention's backward (the
        # gradient of the attention's input).
        block.self_attn.register_forward_pre_hook(_mark(log, ("forward_start", j)))
        block.mlp.register_forward_hook(_mark(log, ("forward_end", j)))
        block.mlp.down_proj.register_forward_pre_hook(_mark_grad(log, ("backward_start", j)))
        block.self_attn.register_forward_pre_hook(_mark_grad(log, ("backward_end", j)))
    _loss(pm.module, *_batch(dims.rank)).backward()
    return log


def worker(rank: int, world_size: int) -> dict:
    dims = ParallelDims.create(comm=Comm(timeout_s=60))
    out = {"ddp": ddp_overlap(dims), "fsdp": fsdp_prefetch(dims)}
    try:  # last: a rank that waits for a bucket its peer never launches gives up after UNUSED_TIMEOUT_S
        out["unused"] = ddp_unused(dims)
    except Exception as e:
        out["unused"] = f"rank {rank}: {type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return spawn(worker, 2, timeout_s=120)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_launches_bucket_all_reduces_during_backward(per_rank):
    for res in per_rank:
        log, buckets = res["ddp"]["log"], res["ddp"]["buckets"]
        assert len(buckets) > 2
        ready = [i for i, e in enumerate(log) if e[0] == "ready"]
        launches = [i for i, e in enumerate(log) if e[0] == "launch"]
        waits = [i for i, e in enumerate(log) if e[0] == "wait"]
        assert len(launches) == len(waits) == len(buckets)
        assert all(log[i][1] for i in launches), "bucket all-reduces must be asynchronous"
        last_ready = ready[-1]
        assert log[last_ready][1] == "embed_tokens.weight"  # the last gradient of backward
        early = [i for i in launches if i < last_ready]
        assert early, f"no bucket all-reduce launched before the last gradient was ready: {_compact(log)}"
        assert len(early) == len(buckets) - 1  # every bucket but the last as soon as it is full
        # A bucket is launched right after its last parameter is ready, before any later bucket's parameter.
        position = {e[1]: i for i, e in enumerate(log) if e[0] == "ready"}
        for k, at in enumerate(launches[:-1]):
            assert max(position[n] for n in buckets[k]) < at < min(position[n] for n in buckets[k + 1])
        assert min(waits) > last_ready  # waited at the end of backward


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_unused_parameters_are_zero_filled(per_rank):
    errors = [res["unused"] for res in per_rank if isinstance(res["unused"], str)]
    assert not errors, "\n".join(errors)
    want = branch_reference(len(per_rank))
    for res in per_rank:
        for got_step, want_step in zip(res["unused"], want, strict=True):
            assert want_step["branch.weight"].abs().sum() > 0  # rank 0's branch gradient, averaged with zeros
            for name, g in want_step.items():
                torch.testing.assert_close(torch.from_numpy(got_step[name]), g, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_prefetches_the_next_units_gather_in_forward(per_rank):
    for log in (res["fsdp"] for res in per_rank):
        at = {e: i for i, e in enumerate(log)}
        for j in range(LAYERS - 1):
            first_gather = [i for i, e in enumerate(log) if e[:2] == ("gather", j + 1)][0]
            assert first_gather < at["forward_end", j], f"unit {j + 1} gathered after block {j} finished: {log}"
            assert log[first_gather][2], f"unit {j + 1}'s forward gather is not asynchronous"
            assert at["forward_start", j] < at["forward_start", j + 1]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_prefetches_the_previous_units_gather_in_backward(per_rank):
    for log in (res["fsdp"] for res in per_rank):
        at = {e: i for i, e in enumerate(log)}
        start = at["forward_end", LAYERS - 1]  # backward's gathers come after
        assert all(at["backward_start", j] < at["backward_end", j] for j in range(LAYERS))
        for j in range(LAYERS - 1, 0, -1):
            gather = [i for i, e in enumerate(log) if e[:2] == ("gather", j - 1) and i > start][0]
            assert gather < at["backward_end", j], f"unit {j - 1} gathered after block {j}'s backward: {log}"
            assert log[gather][2], f"unit {j - 1}'s backward gather is not asynchronous"
