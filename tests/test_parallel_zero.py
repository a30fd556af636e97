"""ZeRO memory and communication, measured from the tensors and the byte counters (ZeRO paper, §5 and §7).

* per-rank bytes of parameters, gradients and optimizer state within 5% of the paper's formulas for stages 0–3
  (fp32 Adam: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N; mixed precision K = 12 for stages 1 and 2);
* volume per step: ZeRO-1/2 move what DDP moves (2Ψ), ZeRO-3 and FSDP 1.5× that (3Ψ).
"""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.data.zero import memory_breakdown, zero_memory_formula

WORLD = 4
LAYOUTS = {
    "ddp": (0, dict()),
    "zero1": (1, dict(zero=1)),
    "zero2": (2, dict(zero=2)),
    "zero3": (3, dict(zero=3)),
    "fsdp": (3, dict(fsdp=True)),
}
MIXED = {"zero1-bf16": (1, dict(zero=1)), "zero2-bf16": (2, dict(zero=2))}


def _model(dtype: torch.dtype) -> Transformer:
    config = preset_config("test", 256, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    return Transformer(config).init_weights(seed=0).to(dtype)


def measure(rank: int, world_size: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (8, 16), generator=gen)
    labels = torch.randint(0, 256, (8, 16), generator=gen)
    mask = torch.ones(8, 16)
    out = {}
    for name, (stage, kwargs) in {**LAYOUTS, **MIXED}.items():
        dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
        model = _model(dtype)
        num_params = sum(p.numel() for p in model.parameters())
        trainer = ParallelTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), ParallelConfig(**kwargs))
        trainer.dims.comm.stats.reset()  # count one step, not the initial broadcast
        trainer.forward_backward(ids, labels, mask)
        trainer.optimizer.step()
        mem = memory_breakdown(trainer.pm.module, trainer.optimizer)  # before zero_grad: the step's full state
        stats = trainer.dims.comm.stats
        out[name] = dict(stage=stage, num_params=num_params, mem=mem, elements=dict(stats.elements))
        trainer.optimizer.zero_grad()
    return out


@pytest.fixture(scope="module")
def measured():
    return spawn(measure, WORLD, timeout_s=180)[0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS) + list(MIXED))
def test_memory_matches_zero_formulas(measured, name):
    m = measured[name]
    want = zero_memory_formula(m["stage"], m["num_params"], WORLD, mixed_precision=name.endswith("bf16"))
    got = m["mem"]
    for key in ("params", "grads", "optimizer"):
        assert got[key] == pytest.approx(want[key], rel=0.05), (name, key, got, want)
    assert sum(got.values()) == pytest.approx(want["total"], rel=0.05)


@pytest.mark.slow
@pytest.mark.distributed
def test_communication_volume_matches_zero_accounting(measured):
    psi = measured["ddp"]["num_params"]
    volume = {name: sum(measured[name]["elements"].values()) for name in LAYOUTS}
    assert volume["ddp"] == 2 * psi  # one all-reduce of every gradient
    assert measured["ddp"]["elements"].keys() == {"all_reduce"}
    for name in ("zero1", "zero2"):
        assert volume[name] / volume["ddp"] == pytest.approx(1.0, rel=0.01), volume
        assert set(measured[name]["elements"]) == {"reduce_scatter", "all_gather"}
    for name in ("zero3", "fsdp"):
        assert volume[name] / volume["ddp"] == pytest.approx(1.5, rel=0.01), volume
