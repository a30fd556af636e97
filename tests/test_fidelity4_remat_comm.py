"""Re-materialisation adds no communication under pure pipeline parallelism (Chen et al., 2016; Huang et al., 2019,
"GPipe", §2: a stage recomputes its own forward from the checkpointed input during backward — local work), counted on
the wire by :func:`~spinwheel.parallel.counting.counting_backend` over whole training steps on 2 gloo ranks.

pp = 2, both schedules, remat none / block / every-k / stage: the same sends (count and bytes) and collectives.

The exception is tensor parallelism: there the recomputed forward re-runs the Megatron ``g`` all-reduces of every
checkpointed block (Shoeybi et al., 2019; Korthikanti et al., 2022, §4: "recomputation ... requires an extra
all-reduce"), two per transformer block (after attention and after the MLP) — at tp = 2 with L blocks, block remat
adds exactly 2L all-reduces of the block activation (B, T, C) per step, the rest equal.
"""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.counting import counting_backend

WORLD, VOCAB, LAYERS, ROWS, T = 2, 64, 4, 4, 10
PP_RUNS = [(s, r) for s in ("gpipe", "1f1b") for r in ("none", "block", "every-k", "stage")]


def _step(layout: dict, ids: torch.Tensor) -> dict:
    config = preset_config("test", VOCAB, num_hidden_layers=LAYERS)
    model = Transformer(config).init_weights(seed=0)
    trainer = ParallelTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ParallelConfig(**layout))
    with counting_backend() as wire:
        loss = trainer.step(ids[:, :-1], ids[:, 1:], torch.ones(ROWS, T))
    return dict(calls=dict(wire.calls), sent=dict(wire.sent), loss=loss)


def worker(rank: int, world_size: int) -> dict:
    ids = torch.randint(0, VOCAB, (ROWS, T + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for schedule, remat in PP_RUNS:
        out["pp", schedule, remat] = _step(dict(pp=2, microbatches=2, schedule=schedule, remat=remat), ids)
    for remat in ("none", "block"):
        out["tp", remat] = _step(dict(tp=2, remat=remat), ids)
    return out


@pytest.fixture(scope="module")
def counted() -> list[dict]:
    return spawn(worker, WORLD, timeout_s=180)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_remat_sends_exactly_what_no_remat_sends(counted, schedule):
    for rank, res in enumerate(counted):
        plain = res["pp", schedule, "none"]
        assert plain["calls"].get("send", 0) == 2  # per micro-batch: stage 0 its activation, stage 1 its gradient
        for remat in ("block", "every-k", "stage"):
            got = res["pp", schedule, remat]
            assert (got["calls"], got["sent"]) == (plain["calls"], plain["sent"]), (rank, schedule, remat)
            assert got["loss"] == pytest.approx(plain["loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_remat_adds_two_all_reduces_per_block(counted):
    x_bytes = ROWS * T * 32 * 4  # one block activation (B, T, C = 32), fp32
    for res in counted:
        plain, remat = res["tp", "none"], res["tp", "block"]
        assert remat["calls"]["all_reduce"] - plain["calls"]["all_reduce"] == 2 * LAYERS
        # each ring all-reduce of |x| sends 2|x|(N − 1)/N = |x| per rank at N = 2
        assert remat["sent"]["all_reduce"] - plain["sent"]["all_reduce"] == 2 * LAYERS * x_bytes
        assert {k: v for k, v in remat["calls"].items() if k != "all_reduce"} == {
            k: v for k, v in plain["calls"].items() if k != "all_reduce"
        }
