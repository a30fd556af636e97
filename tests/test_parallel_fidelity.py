"""Every parallel layout trains exactly like one process: per-step losses and final parameters equal (fp32, relative
1e-5) to single-process training of the same model, data and global batch over 10 steps.

Layouts marked ``clip`` train as the SFT trainer does: a warmup + cosine learning rate set with ``trainer.set_lr``,
AdamW's decoupled weight decay on weight matrices only (``decays``) and global gradient-norm clipping with a max norm
small enough to clip every step; the global norms must equal ``torch.nn.utils.clip_grad_norm_``'s too.

Layouts are grouped into two spawned gloo worlds (2 and 4 CPU ranks) so the suite stays short; each rank trains every
layout of its world in turn and reports the largest relative errors, which the parent asserts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.train.optim import ADAMW_BETAS, build_adamw, decays, lr_at

STEPS = 10
VOCAB, BATCH, SEQ = 64, 8, 12
LR = 1e-3
RTOL = 1e-5
MAX_NORM = 0.5  # the gradient norm of these batches is ~1.2: every step clips
WEIGHT_DECAY = 0.1


def model_config(tied: bool):
    return preset_config("test", VOCAB, num_hidden_layers=4, tie_word_embeddings=tied)


def make_model(tied: bool) -> Transformer:
    return Transformer(model_config(tied)).init_weights(seed=1)


def optimizer_factory(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.3).float()  # uneven token counts per rank
        out.append((ids, labels, mask))
    return out


def clip_optimizer_factory(params):
    """The SFT recipe's AdamW with its decay left to the trainer (``weight_decay`` + ``decays``)."""
    return torch.optim.AdamW(params, lr=LR, betas=ADAMW_BETAS, weight_decay=0.0)


def scheduled_lr(step: int) -> float:
    return lr_at(step, LR, warmup_steps=3, total_steps=STEPS, min_lr_ratio=0.1)


def reference(tied: bool, clip: bool = False) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Single-process training: the oracle every layout is compared against. With ``clip``: the SFT recipe
    (scheduled lr, weight decay on matrices only, gradient clipping at MAX_NORM). Returns losses, final parameters
    and the gradient norms before clipping."""
    model = make_model(tied)
    opt = build_adamw(model, LR, WEIGHT_DECAY) if clip else optimizer_factory(list(model.parameters()))
    losses, norms = [], []
    for step, (ids, labels, mask) in enumerate(batches()):
        if clip:
            for group in opt.param_groups:
                group["lr"] = scheduled_lr(step)
        logits = model(ids)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (ce * mask.flatten()).sum() / mask.sum()
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("rotary")}
    return losses, params, norms


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def run_layouts(rank: int, world_size: int, layouts: list[tuple[str, dict]], refs: dict) -> dict[str, tuple]:
    results = {}
    for name, kwargs in layouts:
        kwargs = dict(kwargs)
        tied, clip = kwargs.pop("tied", False), kwargs.pop("clip", False)
        if clip:
            trainer = ParallelTrainer(
                make_model(tied),
                clip_optimizer_factory,
                ParallelConfig(**kwargs),
                max_grad_norm=MAX_NORM,
                weight_decay=WEIGHT_DECAY,
                decays=decays,
            )
        else:
            trainer = ParallelTrainer(make_model(tied), optimizer_factory, ParallelConfig(**kwargs))
        losses, norms = [], []
        for step, b in enumerate(batches()):
            if clip:
                trainer.set_lr(scheduled_lr(step))
            losses.append(trainer.step(*b))
            norms.append(trainer.grad_norm)
        full = trainer.full_state_dict()
        ref_losses, ref_params, ref_norms = refs[tied, clip]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        missing = sorted(set(ref_params) - set(full))
        param_err = max(rel_err(full[k], v) for k, v in ref_params.items() if k in full)
        if clip:
            loss_err = max([loss_err] + [abs(a - b) / b for a, b in zip(norms, ref_norms)])
        results[name] = (loss_err, param_err, missing)
    return results


LAYOUTS_2 = [
    ("ddp", dict()),
    ("ddp-accum-small-buckets", dict(microbatches=2, bucket_mb=0.01)),
    ("zero1", dict(zero=1, bucket_mb=0.02)),
    ("zero1-accum", dict(zero=1, microbatches=2)),
    ("zero2", dict(zero=2, bucket_mb=0.02)),
    ("zero3", dict(zero=3)),
    ("fsdp", dict(fsdp=True)),
    ("fsdp-tied", dict(fsdp=True, tied=True)),
    ("tp2", dict(tp=2)),
    ("tp2-tied", dict(tp=2, tied=True)),
    ("pp2-gpipe-m1", dict(pp=2, schedule="gpipe", microbatches=1)),
    ("pp2-gpipe-m4", dict(pp=2, schedule="gpipe", microbatches=4)),
    ("pp2-1f1b-m1", dict(pp=2, schedule="1f1b", microbatches=1)),
    ("pp2-1f1b-m4-tied", dict(pp=2, schedule="1f1b", microbatches=4, tied=True)),
    ("ddp-remat", dict(remat=True)),
    ("zero2-remat", dict(zero=2, remat=True)),
    ("zero3-remat", dict(zero=3, remat=True)),
    ("fsdp-remat", dict(fsdp=True, remat=True)),
    ("tp2-remat", dict(tp=2, remat=True)),
    ("pp2-gpipe-m4-remat", dict(pp=2, schedule="gpipe", microbatches=4, remat=True)),
    ("pp2-1f1b-m4-remat", dict(pp=2, schedule="1f1b", microbatches=4, remat=True)),
    ("ddp-clip", dict(clip=True)),
    ("zero1-clip", dict(zero=1, bucket_mb=0.02, clip=True)),
    ("zero2-clip", dict(zero=2, bucket_mb=0.02, clip=True)),
    ("zero3-clip", dict(zero=3, clip=True)),
    ("fsdp-tied-clip", dict(fsdp=True, tied=True, clip=True)),
    ("tp2-clip", dict(tp=2, clip=True)),
    ("pp2-1f1b-m2-tied-clip", dict(pp=2, microbatches=2, tied=True, clip=True)),
]

LAYOUTS_4 = [
    ("ddp-dp4", dict()),
    ("zero2-dp4", dict(zero=2)),
    ("zero3-dp4", dict(zero=3)),
    ("hsdp-2x2", dict(hsdp=2)),
    ("dp2xtp2-ddp", dict(dp=2, tp=2)),
    ("dp2xtp2-fsdp-tied", dict(dp=2, tp=2, fsdp=True, tied=True)),
    ("dp2xtp2-zero1", dict(dp=2, tp=2, zero=1)),
    ("dp2xpp2-ddp-tied", dict(dp=2, pp=2, microbatches=2, tied=True)),
    ("dp2xpp2-zero1", dict(dp=2, pp=2, zero=1, microbatches=2, schedule="gpipe")),
    ("dp2xpp2-fsdp", dict(dp=2, pp=2, fsdp=True, microbatches=2)),
    ("tp2xpp2", dict(tp=2, pp=2, microbatches=4)),
    ("tp2xpp2-tied-gpipe", dict(tp=2, pp=2, microbatches=2, schedule="gpipe", tied=True)),
    ("hsdp-2x2-remat", dict(hsdp=2, remat=True)),
    ("dp2xtp2-remat", dict(dp=2, tp=2, remat=True)),
    ("tp2xpp2-remat", dict(tp=2, pp=2, microbatches=2, remat=True)),
    ("dp2xpp2-remat", dict(dp=2, pp=2, microbatches=2, remat=True)),
    ("hsdp-2x2-clip", dict(hsdp=2, clip=True)),
    ("dp2xtp2-zero1-clip", dict(dp=2, tp=2, zero=1, bucket_mb=0.02, clip=True)),
    ("dp2xpp2-zero1-tied-clip", dict(dp=2, pp=2, zero=1, microbatches=2, tied=True, clip=True)),
    ("tp2xpp2-clip", dict(tp=2, pp=2, microbatches=2, clip=True)),
]


@pytest.fixture(scope="module")
def refs():
    out = {(tied, clip): reference(tied, clip) for tied in (False, True) for clip in (False, True)}
    assert all(n > MAX_NORM for tied in (False, True) for n in out[tied, True][2])  # clipping is active
    return out


def _check(results: list[dict], layouts) -> None:
    failures = []
    for name, _ in layouts:
        for rank, res in enumerate(results):
            loss_err, param_err, missing = res[name]
            if loss_err > RTOL or param_err > RTOL or missing:
                failures.append(
                    f"{name} rank {rank}: loss rel err {loss_err:.2e}, param rel err {param_err:.2e}, missing {missing}"
                )
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size,layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["2ranks", "4ranks"])
def test_layouts_match_single_process(world_size, layouts, refs):
    results = spawn(run_layouts, world_size, args=(layouts, refs), timeout_s=240)
    _check(results, layouts)


def test_world_size_one_is_the_same_code_path(refs):
    layouts = [
        ("ddp", dict()),
        ("zero2", dict(zero=2)),
        ("fsdp-remat", dict(fsdp=True, remat=True)),
        ("accum", dict(microbatches=4)),
        ("zero1-clip", dict(zero=1, clip=True)),
        ("fsdp-tied-clip", dict(fsdp=True, tied=True, clip=True)),
    ]
    _check([run_layouts(0, 1, layouts, refs)], layouts)
