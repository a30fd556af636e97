"""``--engine-tp``: the RL run's engine tensor-parallel over the torchrun ranks, weights resharded from the trainer's
layout (spinwheel/rl/llm/engine_tp.py, spinwheel/engine/tp_reshard.py). Under ZeRO-3 and trainer TP 2 the run
equals one process's (rollouts exactly, losses to 1e-5) and no rank materialises the whole model during a sync;
bad degrees and layouts are refused in one line before any weight is loaded."""

from __future__ import annotations

import pytest
from helpers import small_config

from spinwheel.engine.config import EngineConfig
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.engine_tp import check_engine_tp
from spinwheel.train.metrics import read_metrics

RTOL = 1e-5
LAYOUTS = [("zero3", dict(zero=3)), ("tp2", dict(tp=2))]
pytestmark = pytest.mark.usefixtures("digit_reward")  # the reward module `rl_test_reward:digits` (helpers.py)


def _engine_tp_worker(rank: int, world_size: int, root: str) -> dict:
    from spinwheel.models.hf import load_model
    from spinwheel.models.tokenizer import Tokenizer

    for name, kwargs in LAYOUTS:
        config = small_config(f"{root}/{name}", parallel=ParallelConfig(**kwargs))
        config.engine = EngineConfig(cpu_packed_weights=False, tensor_parallel_size=2)
        train_rl(config)
    full = load_model("test", vocab_size=Tokenizer.char_level().vocab_size)
    return {"full_mb": sum(p.numel() * p.element_size() for p in full.parameters()) / 2**20, **_bucketed(rank)}


def _bucketed(rank: int) -> dict:
    """FSDP dp 2 → engine TP 2 in 4 KiB buckets (smaller than any unit): every engine tensor equals this rank's
    Megatron slice of the full weights, and no gather held more than one bucket."""
    import copy

    import torch
    import torch.distributed as dist

    from spinwheel.engine.tp_reshard import Resharder, empty_shard
    from spinwheel.models.presets import preset_config
    from spinwheel.models.transformer import Transformer
    from spinwheel.parallel import ParallelTrainer
    from spinwheel.parallel.comm import Comm
    from spinwheel.parallel.mesh import Axis
    from spinwheel.parallel.tensor import apply_tensor_parallel

    config = preset_config("test", 100, tie_word_embeddings=True)  # tied: two names, one tensor
    model = Transformer(config).init_weights(seed=3)
    axis = Axis("engine_tp", (0, 1), rank, dist.group.WORLD)
    expected = copy.deepcopy(model)
    apply_tensor_parallel(expected, axis, Comm())  # the reference slices, cut from the full weights
    trainer = ParallelTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), ParallelConfig(fsdp=True))
    shard, dims = empty_shard(config, axis, Comm(), torch.device("cpu"), torch.float32)
    peak = Resharder(trainer.pm, shard, dims, axis, bucket_mb=4 / 1024).sync()
    want = dict(expected.named_parameters())
    return {"bucket_peak": peak, "bucket_equal": all(torch.equal(p, want[k]) for k, p in shard.named_parameters())}


def _records(path) -> list[dict]:
    return [r for r in read_metrics(path) if "reward_mean" in r]


@pytest.mark.slow
@pytest.mark.distributed
def test_engine_tp_equals_one_process_without_the_full_model(tmp_path):
    """ZeRO-3 dp 2 and trainer TP 2 → engine TP 2: the same rewards and losses as one process over 5 steps; each
    rank's engine holds half the weight matrices, and the sync materialises at most one unit (ZeRO-3) or nothing
    (TP: own slices copied) — never the full model."""
    train_rl(small_config(tmp_path / "one"))
    ref = _records(tmp_path / "one" / "metrics.jsonl")
    assert len(ref) == 5 and len({r["reward_mean"] for r in ref}) > 1
    results = spawn(_engine_tp_worker, 2, args=(str(tmp_path),), timeout_s=300)
    assert all(r["bucket_equal"] and 0 < r["bucket_peak"] <= 4096 for r in results), results
    full_mb = results[0]["full_mb"]
    for name, _ in LAYOUTS:
        recs = _records(tmp_path / name / "metrics.jsonl")
        assert [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in ref], name  # identical rollouts
        assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=RTOL, abs=1e-7), name
        for r in recs:
            assert r["mismatch_max"] < 1e-4, name  # the engine's shards hold the trainer's current weights
            assert 0.45 * full_mb < r["engine_copy_mb"] < 0.6 * full_mb, name  # half of every matrix + norms
            peaks = [r[f"engine_sync_peak_mb/rank{k}"] for k in range(2)]
            if name == "tp2":
                assert peaks == [0.0, 0.0]  # each rank copies its own slices: nothing gathered
            else:
                assert all(0 < p < 0.5 * full_mb for p in peaks), (name, peaks, full_mb)  # one unit at a time
            assert r["time/sync"] > 0


def test_bad_degrees_and_layouts_are_refused_in_one_line(tmp_path):
    def config(n: int, rollout_ranks: int | None = None, **parallel):
        c = small_config(tmp_path, parallel=ParallelConfig(**parallel), rollout_ranks=rollout_ranks)
        c.engine = EngineConfig(tensor_parallel_size=n)
        return c

    assert check_engine_tp(config(1), None) == 1
    assert check_engine_tp(config(2), ParallelDims(dp_shard=2, world_size=2)) == 2
    refusals = [
        (config(2), None, "launch with `spinwheel launch --nproc-per-node 2"),
        (config(2), ParallelDims(dp_shard=4, world_size=4), "must equal the number of torchrun ranks (4)"),
        (config(2, pp=2), ParallelDims(pp=2, world_size=2), "--zero 1/2/3, --fsdp or --hsdp over dp 2, or --tp 2"),
        (config(4), ParallelDims(dp_shard=4, world_size=4), "num_key_value_heads (2)"),  # the test model's 2 KV heads
        (config(2, rollout_ranks=1), ParallelDims(dp_shard=2, world_size=2), "--rollout-ranks are alternatives"),
    ]
    for c, dims, message in refusals:
        with pytest.raises(ValueError) as e:
            check_engine_tp(c, dims)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_engine_tp_option():
    from spinwheel.cli import build_parser
    from spinwheel.config import from_args
    from spinwheel.rl.llm.command import _with_run_parts
    from spinwheel.rl.llm.config import RLConfig

    ns = build_parser("grpo").parse_args(["grpo", "--engine-tp", "2"])
    assert _with_run_parts(from_args(RLConfig, ns), ns).engine.tensor_parallel_size == 2
