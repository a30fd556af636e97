"""``--lora-rank`` with ``--engine-tp``: the engine shards hold the frozen base (resharded once) and the policy's
adapters as one adapter slot that every request runs through, updated after each update on every rank
(spinwheel/rl/llm/rollouts/engine_tp.py's PolicyAdapter, spinwheel/engine/multi_lora.py). GRPO under ZeRO-2
and trainer TP 2 on 2 ranks (one engine of TP 2) equals the same LoRA run in one process: rewards and sampled tokens
exactly, losses and the final PEFT adapter to 1e-5, each update moving the adapters' bytes alone."""

from __future__ import annotations

import pytest
from helpers import rel_err, small_config
from test_rl_engine_tp import _recording_tokens, _records

from spinwheel.engine.config import EngineConfig
from spinwheel.parallel import ParallelConfig, spawn
from spinwheel.rl.llm import train_rl

RTOL = 1e-5
LORA = dict(steps=3, lora_rank=4, lora_alpha=8, beta=0.05)
LAYOUTS = [("zero2", dict(zero=2)), ("tp2", dict(tp=2))]


def _worker(rank: int, world_size: int, root: str) -> dict:
    tokens: dict[str, list] = {}
    for name, kwargs in LAYOUTS:
        config = small_config(f"{root}/{name}", parallel=ParallelConfig(**kwargs), **LORA)
        config.engine = EngineConfig(cpu_packed_weights=False, tensor_parallel_size=2)
        with _recording_tokens(tokens.setdefault(name, [])):
            train_rl(config)
    return tokens


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_engine_tp_equals_one_process(tmp_path, digit_reward):
    from safetensors.torch import load_file

    from spinwheel.models.lora_io import ADAPTER_WEIGHTS
    from spinwheel.train.metrics import read_metrics

    ref_tokens: list = []
    with _recording_tokens(ref_tokens):
        train_rl(small_config(tmp_path / "one", **LORA))
    ref = _records(tmp_path / "one" / "metrics.jsonl")
    assert len(ref) == 3 and len({r["reward_mean"] for r in ref}) > 1
    want = load_file(tmp_path / "one" / "checkpoint" / ADAPTER_WEIGHTS)
    adapter_bytes = sum(v.numel() * v.element_size() for v in want.values())
    start = next(r for r in read_metrics(tmp_path / "one" / "metrics.jsonl") if r["step"] == 0)
    assert start["lora_sync_mb"] * 2**20 == adapter_bytes < 0.2 * start["full_sync_mb"] * 2**20
    results = spawn(_worker, 2, args=(str(tmp_path),), timeout_s=300)
    for name, _ in LAYOUTS:
        recs = _records(tmp_path / name / "metrics.jsonl")
        assert [r["reward_mean"] for r in recs] == [r["reward_mean"] for r in ref], name  # identical rollouts
        assert all(r[name] == ref_tokens for r in results), name
        assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=RTOL, abs=1e-7), name
        for r in recs:
            assert r["mismatch_max"] < 1e-4, name  # the engine serves the trainer's current adapters
            assert r["sync_bytes"] == adapter_bytes, name  # each update moves the adapters alone
            assert r["engine_sync_peak_mb"] == 0.0, name  # no weight of the base is gathered again
        have = load_file(tmp_path / name / "checkpoint" / ADAPTER_WEIGHTS)
        assert have.keys() == want.keys() and max(rel_err(have[k], v) for k, v in want.items()) <= RTOL, name


def test_lora_layouts_under_engine_tp(tmp_path):
    """LoRA with --engine-tp is accepted for the data-parallel and TP layouts; the fully sharded ones stay refused
    in one line (LoRA's own refusal: flat units mix frozen and trained weights)."""
    from spinwheel.parallel.mesh import ParallelDims
    from spinwheel.rl.llm.rollouts.engine_tp import check_engine_tp
    from spinwheel.train.lora_run import check_one_process

    def config(**parallel):
        c = small_config(tmp_path, parallel=ParallelConfig(**parallel), **LORA)
        c.engine = EngineConfig(tensor_parallel_size=2)
        return c

    assert check_engine_tp(config(zero=2), ParallelDims(dp_shard=2, world_size=2)) == 2
    assert check_engine_tp(config(tp=2), ParallelDims(tp=2, world_size=2)) == 2
    check_one_process(config(zero=2), True, "grpo")
    with pytest.raises(ValueError, match="^spinwheel grpo --lora-rank runs under DDP .* not --zero 3 ") as e:
        check_one_process(config(zero=3), True, "grpo")
    assert "\n" not in str(e.value)
