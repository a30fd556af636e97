"""Sharded checkpoints: save after half of the fidelity oracle's STEPS, resume in a fresh trainer, train the rest —
the losses and parameters equal STEPS uninterrupted single-process steps; the consolidated HF checkpoint loads into
a plain model with the reference weights."""

from __future__ import annotations

import pytest
import torch
from helpers import RTOL, STEPS, batches, make_model, optimizer_factory, rel_err

from spinwheel.models.hf import load_model
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn

LAYOUTS = [
    ("dp2xtp2-fsdp", dict(dp=2, tp=2, fsdp=True)),
    ("tp2xpp2-tied", dict(tp=2, pp=2, microbatches=2, tied=True)),
    ("dp2xpp2-zero1", dict(dp=2, pp=2, zero=1, microbatches=2)),
    ("dp4-zero2", dict(zero=2)),
]


def resume_and_consolidate(rank: int, world_size: int, root: str, refs: dict) -> dict:
    out = {}
    data = batches()
    for name, kwargs in LAYOUTS:
        kwargs = dict(kwargs)
        tied = kwargs.pop("tied", False)
        config = ParallelConfig(**kwargs)
        first = ParallelTrainer(make_model(tied), optimizer_factory, config)
        losses = [first.step(*b) for b in data[: STEPS // 2]]
        first.save(f"{root}/{name}/sharded")
        second = ParallelTrainer(
            make_model(tied).init_weights(seed=99), optimizer_factory, config
        )  # different weights: everything must come from the checkpoint
        second.load(f"{root}/{name}/sharded")
        losses += [second.step(*b) for b in data[STEPS // 2 :]]
        second.save_hf(f"{root}/{name}/hf")
        ref_losses, ref_params, _ = refs[tied]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        param_err = 0.0
        if rank == 0:
            loaded = load_model(f"{root}/{name}/hf").state_dict()
            param_err = max(rel_err(loaded[k], v) for k, v in ref_params.items())
        out[name] = (loss_err, param_err, second.num_steps)
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_resume_and_hf_consolidation(tmp_path, fidelity_refs):
    refs = {tied: fidelity_refs[tied, False] for tied in (False, True)}
    results = spawn(resume_and_consolidate, 4, args=(str(tmp_path), refs), timeout_s=240)
    for name, _ in LAYOUTS:
        for rank, res in enumerate(results):
            loss_err, param_err, steps = res[name]
            assert steps == STEPS
            assert loss_err <= RTOL and param_err <= RTOL, (name, rank, loss_err, param_err)
    assert (tmp_path / "dp2xtp2-fsdp" / "sharded" / "layout.json").is_file()


def test_resume_on_another_layout_is_refused(tmp_path):
    trainer = ParallelTrainer(make_model(False), optimizer_factory, ParallelConfig())
    trainer.save(str(tmp_path))
    import json

    layout = json.loads((tmp_path / "layout.json").read_text())
    state = torch.load(tmp_path / "rank00000.pt", weights_only=False)
    state["layout"] = {**layout, "tp": 2}
    torch.save(state, tmp_path / "rank00000.pt")
    with pytest.raises(ValueError, match="same degrees"):
        ParallelTrainer(make_model(False), optimizer_factory, ParallelConfig()).load(str(tmp_path))
