"""The trainer's seams for RL: a pluggable per-token loss (with per-token inputs and stats) and a forward-only pass
for log-probs and entropy, under every layout, equal to the single-process reference (fp32, relative 1e-5).

The loss is a PPO-style clipped surrogate with per-token advantages, old log-probs and a β·k3 penalty to
reference log-probs, aggregated with global per-token weights; its stats (clip fraction, KL) are weighted sums.
The reference is :class:`~spinwheel.train.learners.LocalLearner` on plain logits."""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.train.learners import LocalLearner, OptimConfig, ParallelLearner, local_outputs

VOCAB, BATCH, SEQ, STEPS = 64, 8, 10, 3
RTOL = 1e-5
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, grad_clip=0.5)


def make_model(tied: bool = False) -> Transformer:
    return Transformer(preset_config("test", VOCAB, num_hidden_layers=4, tie_word_embeddings=tied)).init_weights(3)


def make_batch(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    lengths = torch.randint(3, SEQ + 1, (BATCH,), generator=gen)
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).float()  # right-padded rows of uneven length
    return {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "weights": mask / mask.sum(),
        "advantages": torch.randn(BATCH, SEQ, generator=gen),
        "old_logprobs": -4.2 + 0.3 * torch.randn(BATCH, SEQ, generator=gen),
        "ref_logprobs": -4.2 + 0.3 * torch.randn(BATCH, SEQ, generator=gen),
    }


def clipped_loss(out, batch):
    """Σ w · (−min(r·A, clip(r)·A) + 0.1·k3): global weights make shard sums exact."""
    w, adv = batch["weights"], batch["advantages"]
    ratio = (out.logprobs - batch["old_logprobs"]).exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    log_r = batch["ref_logprobs"] - out.logprobs
    kl = log_r.exp() - log_r - 1
    loss = (w * (-surrogate + 0.1 * kl)).sum()
    clipped = ((ratio < 0.8) | (ratio > 1.28)).float()
    return loss, {
        "clip_frac": (w * clipped).sum().detach(),
        "kl": (w * kl).sum().detach(),
        "entropy": (w * out.entropy).sum(),
    }


def run(learner) -> dict:
    fwd = learner.forward(make_batch(0), entropy=True)
    losses, stats, norms = [], [], []
    for step in range(STEPS):
        r = learner.train_step(make_batch(step), clipped_loss, 3e-3, entropy=True)
        losses.append(r.loss)
        stats.append(r.stats)
        norms.append(r.grad_norm)
    after = learner.forward(make_batch(STEPS))
    return {
        "logprobs": fwd["logprobs"],
        "entropy": fwd["entropy"],
        "losses": losses,
        "stats": stats,
        "norms": norms,
        "after": after["logprobs"],
    }


def reference(tied: bool) -> dict:
    return run(LocalLearner(make_model(tied), OPTIM))


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def worker(rank: int, world_size: int, layouts: list[tuple[str, dict]], refs: dict) -> dict[str, float]:
    errors = {}
    for name, kwargs in layouts:
        kwargs = dict(kwargs)
        tied = kwargs.pop("tied", False)
        got, ref = (
            run(ParallelLearner(make_model(tied), OPTIM, ParallelConfig(**kwargs), engine_copy="none")),
            refs[tied],
        )
        errs = [rel(got[k], ref[k]) for k in ("logprobs", "entropy", "losses", "norms", "after")]
        errs += [rel([s[k] for s in got["stats"]], [s[k] for s in ref["stats"]]) for k in ref["stats"][0]]
        errors[name] = max(errs)
    return errors


LAYOUTS_2 = [
    ("ddp-accum", dict(microbatches=2)),
    ("zero2", dict(zero=2)),
    ("zero3", dict(zero=3)),
    ("fsdp-tied", dict(fsdp=True, tied=True)),
    ("tp2", dict(tp=2)),
    ("pp2-1f1b-m2", dict(pp=2, microbatches=2)),
    ("pp2-gpipe-m4-tied", dict(pp=2, microbatches=4, schedule="gpipe", tied=True)),
]
LAYOUTS_4 = [("dp2xtp2-fsdp", dict(dp=2, tp=2, fsdp=True)), ("tp2xpp2", dict(tp=2, pp=2, microbatches=2))]


@pytest.fixture(scope="module")
def refs():
    return {tied: reference(tied) for tied in (False, True)}


def test_reference_outputs_are_the_formula():
    """The single-process reference itself: log-probs and entropy from a log-softmax written out here."""
    model, batch = make_model(), make_batch(0)
    out = local_outputs(model, batch, entropy=True)
    logp = torch.log_softmax(model(batch["input_ids"]).double(), -1)
    picked = logp.gather(-1, batch["labels"][..., None])[..., 0]
    assert torch.allclose(out.logprobs.double(), picked, atol=1e-5)
    assert torch.allclose(out.entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world_size,layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["2ranks", "4ranks"])
def test_pluggable_loss_and_forward_match_single_process(world_size, layouts, refs):
    results = spawn(worker, world_size, args=(layouts, refs), timeout_s=240)
    bad = [
        f"{name} rank {r}: rel err {res[name]:.2e}"
        for r, res in enumerate(results)
        for name, _ in layouts
        if not res[name] <= RTOL
    ]
    assert not bad, "\n".join(bad)
    assert refs[False]["stats"][0]["clip_frac"] > 0 or refs[False]["stats"][-1]["clip_frac"] > 0


def test_world_size_one(refs):
    errors = worker(0, 1, [("one", dict()), ("zero3-accum", dict(zero=3, microbatches=2))], refs)
    assert all(e <= RTOL for e in errors.values()), errors
