"""``--engine-tp``: the RL run's engine tensor-parallel over the torchrun ranks, weights resharded from the trainer's
layout (spinwheel/rl/llm/rollouts/engine_tp.py, spinwheel/engine/parallel/tp_reshard.py). Under ZeRO-3 and trainer TP 2
on 2 ranks
(one engine), and ZeRO-3 over dp 4 and trainer dp 2 × tp 2 on 4 ranks (two engines of TP 2), the run equals one
process's (rewards and sampled tokens exactly, losses to 1e-5) and no rank materialises the whole model during a
sync; bad degrees and layouts are refused in one line before any weight is loaded."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from helpers import REWARD_MODULE, small_config

from spinwheel.engine.config import EngineConfig
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.parallel.mesh import ParallelDims
from spinwheel.rl.llm import train_rl
from spinwheel.rl.llm.rollouts.engine_tp import check_engine_tp
from spinwheel.rl.llm.rollouts.episode_source import EpisodeSource
from spinwheel.train.metrics import read_metrics

RTOL = 1e-5
LAYOUTS = [("zero3", dict(zero=3)), ("tp2", dict(tp=2))]
LAYOUTS_4 = [("zero3_dp4", dict(zero=3)), ("dp2_tp2", dict(tp=2))]  # 4 ranks: two engines of TP 2
pytestmark = pytest.mark.usefixtures("digit_reward")  # the reward module `rl_test_reward:digits` (helpers.py)


@contextlib.contextmanager
def _recording_tokens(steps: list):
    """Each step's sampled episodes (their token ids, in the order the loss sees them) appended to ``steps``."""
    play = EpisodeSource.play

    def recorded(self, step, *args, **kwargs):
        episodes, seconds = play(self, step, *args, **kwargs)
        steps.append([list(e.token_ids) for e in episodes])
        return episodes, seconds

    with mock.patch.object(EpisodeSource, "play", recorded):
        yield


def _runs(root: str, layouts, **kw) -> dict:
    """Each layout's run with --engine-tp 2; the tokens this rank trained on, per layout and step."""
    tokens: dict[str, list] = {}
    for name, kwargs in layouts:
        config = small_config(f"{root}/{name}", parallel=ParallelConfig(**kwargs), **kw)
        config.engine = EngineConfig(cpu_packed_weights=False, tensor_parallel_size=2)
        with _recording_tokens(tokens.setdefault(name, [])):
            train_rl(config)
    return tokens


def _full_mb() -> float:
    from spinwheel.models.hf import load_model
    from spinwheel.models.tokenizer import Tokenizer

    full = load_model("test", vocab_size=Tokenizer.char_level().vocab_size)
    return sum(p.numel() * p.element_size() for p in full.parameters()) / 2**20


def _engine_tp_worker(rank: int, world_size: int, root: str) -> dict:
    return {"tokens": _runs(root, LAYOUTS), "full_mb": _full_mb(), **_bucketed(rank)}


def _four_rank_worker(rank: int, world_size: int, root: str) -> dict:
    return {"tokens": _runs(root, LAYOUTS_4, steps=3), "full_mb": _full_mb()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process's 5-step run: its metrics records and its sampled tokens per step."""
    root = tmp_path_factory.mktemp("reward")
    (root / "rl_test_reward.py").write_text(REWARD_MODULE)
    tokens: list = []
    with pytest.MonkeyPatch.context() as mp, _recording_tokens(tokens):
        mp.syspath_prepend(str(root))
        train_rl(small_config(root / "one"))
    return _records(root / "one" / "metrics.jsonl"), tokens


def _bucketed(rank: int) -> dict:
    """FSDP dp 2 → engine TP 2 in 4 KiB buckets (smaller than any unit): every engine tensor equals this rank's
    Megatron slice of the full weights, and no gather held more than one bucket."""
    import copy

    import torch
    import torch.distributed as dist

    from spinwheel.engine.parallel.tp_reshard import Resharder, empty_shard
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
def test_engine_tp_equals_one_process_without_the_full_model(tmp_path, reference):
    """ZeRO-3 dp 2 and trainer TP 2 → engine TP 2: the same rewards, tokens and losses as one process over 5 steps;
    each rank's engine holds half the weight matrices, and the sync materialises at most one unit (ZeRO-3) or
    nothing (TP: own slices copied) — never the full model."""
    ref, ref_tokens = reference
    assert len(ref) == 5 and len({r["reward_mean"] for r in ref}) > 1
    results = spawn(_engine_tp_worker, 2, args=(str(tmp_path),), timeout_s=300)
    assert all(r["bucket_equal"] and 0 < r["bucket_peak"] <= 4096 for r in results), results
    _check_runs(tmp_path, LAYOUTS, results, ref, ref_tokens)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_engines_on_four_ranks_equal_one_process(tmp_path, reference):
    """4 ranks, engine TP 2 → two engines (ranks 0-1, 2-3), each playing half of every step's groups: under ZeRO-3
    over dp 4 (units gathered over all 4 ranks, each keeping its engine rank's slices) and trainer dp 2 × tp 2 (own
    slices copied) the first 3 steps equal one process's, on every rank, and no rank's sync holds the model."""
    ref, ref_tokens = reference
    results = spawn(_four_rank_worker, 4, args=(str(tmp_path),), timeout_s=300)
    _check_runs(tmp_path, LAYOUTS_4, results, ref[:3], ref_tokens[:3])


def _check_runs(root, layouts, results: list[dict], ref: list[dict], ref_tokens: list) -> None:
    """Every layout's run equals the reference (rewards, every rank's tokens, losses); every rank's engine holds
    about half of the model, and its sync peak is nothing (trainer TP) or less than half of the model (ZeRO-3)."""
    full_mb, ranks = results[0]["full_mb"], len(results)
    for name, _ in layouts:
        recs = _records(root / name / "metrics.jsonl")
        assert [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in ref], name  # identical rollouts
        assert all(r["tokens"][name] == ref_tokens for r in results), name  # every rank trains on them
        assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=RTOL, abs=1e-7), name
        for r in recs:
            assert r["mismatch_max"] < 1e-4, name  # the engine's shards hold the trainer's current weights
            assert 0.45 * full_mb < r["engine_copy_mb"] < 0.6 * full_mb, name  # half of every matrix + norms
            peaks = [r[f"engine_sync_peak_mb/rank{k}"] for k in range(ranks)]
            if "tp2" in name:
                assert peaks == [0.0] * ranks  # each rank copies its own slices: nothing gathered
            else:
                assert all(0 < p < 0.5 * full_mb for p in peaks), (name, peaks, full_mb)  # one unit at a time
            assert all(r[f"engine_sync_s/rank{k}"] > 0 for k in range(ranks)) and r["time/sync"] > 0


def test_bad_degrees_and_layouts_are_refused_in_one_line(tmp_path):
    def config(n: int, rollout_ranks: int | None = None, engine_pp: int = 1, **parallel):
        c = small_config(tmp_path, parallel=ParallelConfig(**parallel), rollout_ranks=rollout_ranks)
        c.engine = EngineConfig(tensor_parallel_size=n, pipeline_parallel_size=engine_pp)
        return c

    assert check_engine_tp(config(1), None) == 1
    assert check_engine_tp(config(2), ParallelDims(dp_shard=2, world_size=2)) == 2
    assert check_engine_tp(config(2), ParallelDims(dp_shard=4, world_size=4)) == 2  # two engines
    assert check_engine_tp(config(2, tp=2), ParallelDims(dp_shard=2, tp=2, world_size=4)) == 2
    crossed = ParallelDims(dp_shard=2, tp=2, world_size=4)
    crossed.grid = lambda: torch.arange(4).view(1, 1, 2, 2).transpose(2, 3)  # TP groups {0, 2} and {1, 3}
    refusals = [
        (config(2), None, "launch with `spinwheel launch --nproc-per-node 2"),
        (config(2), ParallelDims(dp_shard=3, world_size=3), "must divide the number of torchrun ranks (3)"),
        (config(2, pp=2), ParallelDims(pp=2, world_size=2), "--fsdp or --hsdp over any dp, or --tp 2 (× any dp"),
        (config(2, tp=4), ParallelDims(tp=4, world_size=4), "got dp 1, tp 4, pp 1"),  # trainer TP ≠ engine TP
        (config(2, tp=2), crossed, "the trainer's TP groups are not the engines' consecutive ranks"),
        (config(4), ParallelDims(dp_shard=4, world_size=4), "num_key_value_heads (2)"),  # the test model's 2 KV heads
        (config(2, rollout_ranks=1), ParallelDims(dp_shard=2, world_size=2), "--rollout-ranks are alternatives"),
        (
            config(2, engine_pp=2),
            ParallelDims(dp_shard=2, world_size=2),
            "tensor-parallel only; drop --engine-pipeline-parallel-size 2",
        ),
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
