"""TRPO for LLM policies (the trust region holds; data-parallel steps equal one process) and PPO with a critic
on the RL loop (the critic trains, is checkpointed and resumed; the adaptive KL controller moves β)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import small_config
from torch.nn.attention import SDPBackend, sdpa_kernel

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.algorithms.trpo import fisher_rows, logit_fisher_product, trpo_update
from spinwheel.rl.llm.token_losses import token_weights
from spinwheel.rl.trpo import fisher_vector_product
from spinwheel.train.learners import LocalLearner, ParallelLearner, local_outputs
from spinwheel.train.metrics import read_metrics

VOCAB, BATCH, SEQ = 48, 8, 9
pytestmark = pytest.mark.usefixtures("digit_reward")  # the reward module `rl_test_reward:digits` (helpers.py)


def make_model() -> Transformer:
    return Transformer(preset_config("test", VOCAB, num_hidden_layers=2)).init_weights(5)


def make_batch(model) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    mask = (torch.arange(SEQ)[None] >= torch.randint(1, 5, (BATCH, 1), generator=gen)).float()
    batch = {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "weights": token_weights(mask, "token-mean"),
        "advantages": torch.randn(BATCH, 1, generator=gen).expand(BATCH, SEQ) * mask,
    }
    with torch.no_grad():
        batch["old_logprobs"] = local_outputs(model, batch, False).logprobs
    return batch


def full_kl(before: torch.Tensor, model, batch) -> float:
    """Σ w · KL(π_old ‖ π_new) over the whole vocabulary, written out from the logits."""
    with torch.no_grad():
        p_old = F.log_softmax(before, -1)
        p_new = F.log_softmax(model(batch["input_ids"]).float(), -1)
        return float((batch["weights"] * (p_old.exp() * (p_old - p_new)).sum(-1)).sum())


@pytest.mark.parametrize("max_kl, fisher_fraction", [(1e-3, 1.0), (1e-2, 1.0), (1e-2, 0.5)])
def test_trpo_step_stays_in_the_trust_region(max_kl, fisher_fraction):
    """Also with the Fisher-vector products on half the rows: the KL check runs on the whole batch."""
    model = make_model()
    batch = make_batch(model)
    with torch.no_grad():
        before = model(batch["input_ids"]).float()
        params_before = torch.cat([p.flatten() for p in model.parameters()]).clone()
    stats = trpo_update(
        LocalLearner(model, None), batch, max_kl=max_kl, damping=0.1, cg_iters=10, fisher_fraction=fisher_fraction
    )
    measured = full_kl(before, model, batch)
    assert stats["accepted"] == 1.0 and stats["surrogate_improvement"] > 0
    assert measured <= max_kl * (1 + 1e-4) and measured == pytest.approx(stats["kl"], rel=1e-3)
    assert measured > 0.05 * max_kl  # a real step, not a rejected one
    assert not torch.equal(params_before, torch.cat([p.flatten() for p in model.parameters()]))


def test_gauss_newton_fisher_product_equals_the_kl_hessian():
    """Jᵀ M J v (forward-mode J v, one backward) equals ∇(∇KL · v) by double back-propagation at θ_old."""
    model = make_model()
    batch = make_batch(model)
    ids, w = batch["input_ids"], batch["weights"]
    with torch.no_grad():
        old = F.log_softmax(model(ids).float(), -1)

    def kl_fn():
        return (w * (old.exp() * (old - F.log_softmax(model(ids).float(), -1))).sum(-1)).sum()

    params, gauss_newton = logit_fisher_product(model, ids, w, old, damping=0.05)
    assert [id(p) for p in params] == [id(p) for p in dict.fromkeys(model.parameters())]  # tied weights once
    with sdpa_kernel(SDPBackend.MATH):
        hessian = fisher_vector_product(kl_fn, params, damping=0.05)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        v = torch.randn(sum(p.numel() for p in params), generator=gen)
        with sdpa_kernel(SDPBackend.MATH):  # double back-propagation: the math attention kernel has it
            got, ref = gauss_newton(v), hessian(v)
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item())
        assert (got - 0.05 * v).abs().max() > 1e-3 * v.abs().max()  # the Fisher term is not negligible


def test_fisher_rows_are_strided_over_weighted_rows_and_rescaled():
    w = torch.ones(10, 3)
    w[3] = 0  # a row without completion tokens (a dropped group) is never picked
    assert fisher_rows(w, 1.0) == (None, 1.0)
    rows, scale = fisher_rows(w, 0.5)
    assert rows.tolist() == [0, 2, 5, 7, 9] and scale == pytest.approx(27 / 15)
    assert fisher_rows(w, 0.2)[0].tolist() == [0, 6]
    # every row the same sequence: the scaled subset's Fisher-vector product is the whole batch's, exactly
    model = make_model()
    one = make_batch(model)
    ids, w = one["input_ids"][:1].expand(8, -1), one["weights"][:1].expand(8, -1) / 8
    with torch.no_grad():
        old = F.log_softmax(model(ids).float(), -1)
    rows, scale = fisher_rows(w, 0.25)
    assert rows.tolist() == [0, 4] and scale == pytest.approx(4.0)
    params, full = logit_fisher_product(model, ids, w, old, damping=0.0)
    _, part = logit_fisher_product(model, ids[rows], w[rows] * scale, old[rows], damping=0.0)
    v = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(1))
    want = full(v)
    assert torch.allclose(part(v), want, rtol=1e-4, atol=1e-6 * want.abs().max().item())


def _flat(model) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def _trpo_worker(rank: int, world_size: int) -> list[list[float]]:
    out = []
    for fraction in (1.0, 0.5):
        model = make_model()
        batch = make_batch(model)
        learner = ParallelLearner(model, None, ParallelConfig(), engine_copy="none")
        trpo_update(learner, batch, max_kl=1e-2, damping=0.1, cg_iters=10, fisher_fraction=fraction)
        out.append(_flat(learner.trainer.pm.stage))  # plain floats: tensors through the result queue can stall
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_trpo_data_parallel_equals_one_process():
    """Fisher-vector products, gradients and line-search values all-reduced: two ranks take one process's step,
    also with the products on half the rows (picked on the global batch)."""
    refs = []
    for fraction in (1.0, 0.5):
        model = make_model()
        trpo_update(
            LocalLearner(model, None),
            make_batch(model),
            max_kl=1e-2,
            damping=0.1,
            cg_iters=10,
            fisher_fraction=fraction,
        )
        refs.append(torch.tensor(_flat(model)))
        assert not torch.equal(refs[-1], torch.tensor(_flat(make_model())))  # the step moved the parameters
    assert not torch.allclose(refs[0], refs[1], rtol=1e-4, atol=1e-6)  # subsampling changes the step
    for got in spawn(_trpo_worker, 2, timeout_s=120):
        for g, ref in zip(got, refs):
            assert torch.allclose(torch.tensor(g), ref, rtol=1e-4, atol=1e-6)


def test_ppo_trains_its_critic_and_resumes(tmp_path):
    config = small_config(
        tmp_path, algo="ppo", steps=4, save_every=2, stop_after=2, critic_lr=3e-3, kl_target=0.01, beta=0.1
    )
    train_rl(config)
    assert (tmp_path / "critic" / "config.json").is_file()
    train_rl(small_config(tmp_path, algo="ppo", steps=4, save_every=2, critic_lr=3e-3, kl_target=0.01, beta=0.1))
    recs = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "value_loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert len({round(r["kl_coef"], 9) for r in recs}) > 1  # the adaptive controller moved β
    full = tmp_path / "full"
    train_rl(small_config(full, algo="ppo", steps=4, critic_lr=3e-3, kl_target=0.01, beta=0.1))
    ref = [r for r in read_metrics(full / "metrics.jsonl") if "value_loss" in r]
    for a, b in zip(recs, ref):  # resumed run == uninterrupted run (critic and β restored)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9)
        assert a["value_loss"] == pytest.approx(b["value_loss"], rel=1e-6)
