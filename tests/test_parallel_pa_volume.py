"""ZeRO-R's partitioned activation checkpoints (Pa) cost about a tenth of the model-parallel communication
(Rajbhandari et al., 2020, "ZeRO", §8: "the total communication overhead of Pa is less than 10% of the original
communication volume for model parallelism"), measured from the comm counters of one training step at tp = 2.

The paper's count, per transformer block of activation x (B, T, C), with every block checkpointed: Megatron runs two
all-reduces of |x| forward, two again in the recomputation and two backward, 6 all-reduces of 2|x| each (ZeRO
accounting): 12|x|. Pa adds one all-gather of |x| per checkpoint, before its recomputation: a ratio of 1/12 ≈ 8.3%.
Differencing steps of L = 4 and L = 2 blocks isolates the per-block volumes, whose ratio is exactly that.

The whole model also communicates outside the blocks (:mod:`tests.test_parallel_tp_comm`): the vocab-parallel
embedding's ``g`` forward and the column-parallel head's ``f`` backward, 2·2|x|, and the vocab-parallel cross-entropy's
max and (target logit, partition function) all-reduces, 2·3·B·T. Pa adds nothing there, so the step's ratio is

    L·B·T·C / (2·((6L + 2)·B·T·C + 3·B·T)) = L / (12L + 4 + 6/C),

7.7% for L = 4, C = 32 — tending to the paper's 1/12 as L grows.
"""

from __future__ import annotations

import pytest
import torch

from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import Transformer
from spinwheel.parallel import ParallelConfig, ParallelTrainer, spawn
from spinwheel.parallel.comm import metrics_since

TP, VOCAB, B, T, C = 2, 64, 4, 10, 32
X = B * T * C  # elements of one block input
RUNS = [(2, "block", "none"), (2, "block", "tp"), (4, "none", "none"), (4, "block", "none"), (4, "block", "tp")]


def step_volume(layers: int, remat: str, partition: str) -> dict[str, int]:
    """Bytes each tensor-parallel operation moved in one training step, by operation."""
    config = preset_config("test", VOCAB, num_hidden_layers=layers)
    assert config.hidden_size == C
    model = Transformer(config).init_weights(seed=0)
    layout = ParallelConfig(tp=TP, remat=remat, remat_partition=partition)
    trainer = ParallelTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), layout)
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(0))
    before = trainer.dims.comm.stats.metrics()
    trainer.step(ids[:, :-1], ids[:, 1:], torch.ones(B, T))
    moved = metrics_since(trainer.dims.comm.stats.metrics(), before)
    return {k.split("/")[2]: v for k, v in moved.items() if k.startswith("comm/tp/") and k.endswith("/bytes")}


def worker(rank: int, world_size: int) -> dict:
    return {run: step_volume(*run) for run in RUNS}


@pytest.fixture(scope="module")
def volumes() -> list[dict]:
    return spawn(worker, TP, timeout_s=120)


def _mp_and_pa(volume: dict[str, int]) -> tuple[int, int]:
    """(model-parallel all-reduce bytes, Pa's all-gather bytes); nothing else moves on the tp axis."""
    assert set(volume) <= {"all_reduce", "all_gather"}, volume
    return volume["all_reduce"], volume.get("all_gather", 0)


@pytest.mark.slow
@pytest.mark.distributed
def test_pa_costs_one_twelfth_of_the_model_parallel_volume_per_block(volumes):
    for res in volumes:
        mp2, pa2 = _mp_and_pa(res[2, "block", "tp"])
        mp4, pa4 = _mp_and_pa(res[4, "block", "tp"])
        assert (mp2, mp4) == (res[2, "block", "none"]["all_reduce"], res[4, "block", "none"]["all_reduce"])
        mp_block, pa_block = (mp4 - mp2) // 2, (pa4 - pa2) // 2
        assert (mp_block, pa_block) == (12 * 4 * X, 4 * X)  # fp32: 12|x| and |x|
        assert pa_block / mp_block == pytest.approx(1 / 12) and pa_block / mp_block < 0.10


@pytest.mark.slow
@pytest.mark.distributed
def test_pa_overhead_of_a_whole_step_matches_the_formula(volumes):
    layers = 4
    for res in volumes:
        mp, pa = _mp_and_pa(res[layers, "block", "tp"])
        assert pa == 4 * layers * X and mp == 4 * 2 * ((6 * layers + 2) * X + 3 * B * T)
        assert pa / mp == pytest.approx(layers / (12 * layers + 4 + 6 / C), rel=1e-12)
        assert abs(pa / mp - 1 / 12) < 0.01  # near the paper's per-block figure, under its 10%
        no_remat, _ = _mp_and_pa(res[layers, "none", "none"])
        assert no_remat == 4 * 2 * ((4 * layers + 2) * X + 3 * B * T)  # recomputation re-runs 2L all-reduces
