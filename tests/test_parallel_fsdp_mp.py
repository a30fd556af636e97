"""FSDP / ZeRO-3 mixed precision (FSDP2's ``MixedPrecisionPolicy``): fp32 master shards, bf16 compute parameters
gathered in bf16, gradients reduced in fp32 or bf16, AdamW on the fp32 masters.

* parity: every layout trains like a hand-written single-process loop under the same policy — an fp32 master
  model, a bf16 cast copy per step for forward and backward, each data-parallel rank's rows run separately and
  their bf16 gradients summed in the reduce dtype, divided by the degree, cast to fp32 for AdamW. The parity error
  is far below the gap between the bf16 and the fp32 trajectories (which it therefore resolves);
* per-rank bytes: fp32 masters 4Ψ/N, fp32 shard gradients 4Ψ/N, Adam 8Ψ/N and the bf16 parameters of the units
  gathered at once (the root, the block that runs and the prefetched one: 2 bytes each; ZeRO-3 does not prefetch)
  within 5% of
  :func:`~spinwheel.parallel.data.mixed_precision.fsdp_memory_formula`.

bf16 matmuls are slow on CPU, so the model is tiny and the run short.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.data.mixed_precision import fsdp_memory_formula
from spinwheel.parallel.data.zero import memory_breakdown

STEPS, VOCAB, BATCH, SEQ, LR = 4, 64, 8, 8, 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_model(tied: bool = False) -> Transformer:
    config = preset_config("test", VOCAB, num_hidden_layers=4, tie_word_embeddings=tied)
    return Transformer(config).init_weights(seed=1)


def optimizer_factory(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def batches():
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.3).float()
        out.append((ids, labels, mask))
    return out


def reference(
    dp: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype, tied: bool = False, shard: int | None = None
):
    """Single-process training under the policy; ``dp`` row slices stand for the data-parallel ranks, their
    gradients summed within groups of ``shard`` consecutive ranks first (HSDP's reduce-scatter), then across the
    groups (its replica all-reduce)."""
    shard = shard or dp
    master = make_model(tied)
    opt = optimizer_factory(list(master.parameters()))
    losses = []
    for ids, labels, mask in batches():
        weights = mask / mask.sum()
        compute = copy.deepcopy(master)  # the gathered bf16 parameters (tied ones stay tied; buffers stay fp32)
        params = list(compute.parameters())
        for p in params:
            p.data = p.data.to(param_dtype)
        total, summed, group = 0.0, None, None
        rows = BATCH // dp
        for r in range(dp):
            sl = slice(r * rows, (r + 1) * rows)
            logits = compute(ids[sl])
            ce = F.cross_entropy(logits.float().flatten(0, 1), labels[sl].flatten(), reduction="none")
            loss = (ce * weights[sl].flatten()).sum() * dp  # the trainer scales by dp, the reduction divides
            grads = [g.to(reduce_dtype) for g in torch.autograd.grad(loss, params)]
            group = grads if group is None else [a + b for a, b in zip(group, grads)]
            if (r + 1) % shard == 0:
                summed = group if summed is None else [a + b for a, b in zip(summed, group)]
                group = None
            total += loss.item() / dp
        for p, g in zip(master.parameters(), summed):
            p.grad = g.div_(dp).to(p.dtype)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items() if not k.startswith("rotary")}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def run(rank: int, world_size: int, layouts: list[tuple[str, dict]], refs: dict) -> dict:
    """Train each layout; report its largest relative errors against ``refs[name]`` and its memory figures."""
    out = {}
    for name, kwargs in layouts:
        kwargs = dict(kwargs)
        tied = kwargs.pop("tied", False)
        trainer = ParallelTrainer(make_model(tied), optimizer_factory, ParallelConfig(**kwargs))
        losses = []
        for step, b in enumerate(batches()):
            losses.append(trainer.forward_backward(*b))
            trainer.optimizer.step()
            mem = memory_breakdown(trainer.pm.module, trainer.optimizer)  # masters, gradients, Adam moments
            trainer.optimizer.zero_grad()
        fsdp = trainer.pm.module
        units = [u.padded_numel for u in fsdp.units]
        dtypes = {u.full.dtype for u in fsdp.units} | {u.shard.dtype for u in fsdp.units}
        full = trainer.full_state_dict()
        ref_losses, ref_params = refs[name]
        out[name] = dict(
            loss_err=max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
            param_err=max(rel_err(full[k], v) for k, v in ref_params.items()),
            mem=mem,
            gathered=fsdp.peak_gathered_bytes,
            units=units,
            dtypes=dtypes,
        )
    return out


LAYOUTS = [
    ("fsdp-bf16-fp32reduce", dict(fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")),
    ("fsdp-bf16-bf16reduce", dict(fsdp=True, fsdp_param_dtype="bf16")),
    ("zero3-bf16-fp32reduce-tied", dict(zero=3, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32", tied=True)),
]


def _policy(name: str) -> tuple[torch.dtype, torch.dtype]:
    return torch.bfloat16, torch.float32 if "fp32reduce" in name else torch.bfloat16


@pytest.fixture(scope="module")
def refs():
    out = {}
    for dp in (1, 2):
        for name, kwargs in LAYOUTS:
            out[dp, name] = reference(dp, *_policy(name), tied=kwargs.get("tied", False))
    out["fp32"] = reference(1, torch.float32, torch.float32)
    return out


HSDP_LAYOUTS = [
    ("hsdp-bf16-fp32reduce", dict(hsdp=2, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")),
    ("hsdp-bf16-bf16reduce-cb", dict(hsdp=2, fsdp_param_dtype="bf16", fsdp_buffer_mb=0.01)),
]


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_mixed_precision_matches_single_process_policy():
    refs = {name: reference(4, *_policy(name), shard=2) for name, _ in HSDP_LAYOUTS}
    for res in spawn(run, 4, args=(HSDP_LAYOUTS, refs), timeout_s=300):
        for name, _ in HSDP_LAYOUTS:
            assert res[name]["loss_err"] < 1e-6 and res[name]["param_err"] < 1e-6, (name, res[name])


def run_then_resume(rank: int, world_size: int, layouts, refs: dict, path: str) -> dict:
    """:func:`run`, then :func:`resume` on the same ranks (one spawned world for both)."""
    return {"layouts": run(rank, world_size, layouts, refs), "resume": resume(rank, world_size, path)}


@pytest.fixture(scope="module")
def two_ranks(refs, tmp_path_factory) -> list[dict]:
    dp2_refs = {name: refs[2, name] for name, _ in LAYOUTS}
    path = str(tmp_path_factory.mktemp("resume"))
    return spawn(run_then_resume, 2, args=(LAYOUTS, dp2_refs, path), timeout_s=480)


@pytest.fixture(scope="module")
def results(refs, two_ranks):
    one = spawn(run, 1, args=(LAYOUTS, {name: refs[1, name] for name, _ in LAYOUTS}), timeout_s=300)
    return {1: one, 2: [r["layouts"] for r in two_ranks]}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS])
def test_mixed_precision_matches_single_process_policy(results, refs, dp, name):
    _, ref_params = refs[dp, name]
    for res in results[dp]:
        got = res[name]
        assert got["dtypes"] == {torch.bfloat16, torch.float32}  # bf16 gathered buffers, fp32 master shards
        loss_err, param_err = got["loss_err"], got["param_err"]
        assert loss_err < 1e-6 and param_err < 1e-6, (name, dp, loss_err, param_err)
    # The policy matters at this tolerance: bf16 compute is far from the fp32 trajectory (measured ~1e-2), and
    # with two ranks the reduce dtype changes the result too (~7e-4).
    if "tied" not in name:
        assert max(rel_err(ref_params[k], v) for k, v in refs["fp32"][1].items()) > 1e-3
        other = name.replace("fp32reduce", "bf16reduce") if "fp32reduce" in name else name.replace("bf16r", "fp32r")
        gap = max(rel_err(ref_params[k], v) for k, v in refs[2, other][1].items())
        assert dp == 1 or gap > 1e-4, gap


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS])
def test_mixed_precision_bytes_match_formula(results, name):
    got = results[2][0][name]
    units = got["units"]
    # Peak: the root (held through forward and backward), the block that runs and, with FSDP's prefetch (not
    # ZeRO-3's), the next one.
    blocks = [0, 1] if name.startswith("fsdp") else [0]
    want = fsdp_memory_formula(units, 2, max_gathered=[len(units) - 1, *blocks])
    for key in ("params", "grads", "optimizer"):
        assert got["mem"][key] == pytest.approx(want[key], rel=0.05), (key, got["mem"], want)
    assert got["gathered"] == pytest.approx(want["gathered"], rel=0.05), (got["gathered"], want)
    total = sum(got["mem"].values()) + got["gathered"]
    assert total == pytest.approx(want["total"], rel=0.05)


def resume(rank: int, world_size: int, path: str) -> tuple[list[float], list[float]]:
    """Losses of an uninterrupted run and of one saved after two steps and resumed in a new trainer."""
    config = dict(fsdp=True, fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32", fsdp_buffer_mb=0.01)
    whole = ParallelTrainer(make_model(), optimizer_factory, ParallelConfig(**config))
    uninterrupted = [whole.step(*b) for b in batches()]
    first = ParallelTrainer(make_model(), optimizer_factory, ParallelConfig(**config))
    halves = [first.step(*b) for b in batches()[:2]]
    first.save(path)
    second = ParallelTrainer(make_model(), optimizer_factory, ParallelConfig(**config))
    second.load(path)
    halves += [second.step(*b) for b in batches()[2:]]
    return uninterrupted, halves


@pytest.mark.slow
@pytest.mark.distributed
def test_mixed_precision_resumes_from_sharded_masters(two_ranks):
    for uninterrupted, halves in (r["resume"] for r in two_ranks):
        assert halves == uninterrupted  # the fp32 masters and Adam moments are the whole training state
