"""The engine's memory under a server's mix of requests (issue 12's soak: "RSS flat").

The engine process of ``spinwheel serve`` grew by ~0.4 GiB in four minutes of the soak. The cause was oneDNN, not
Python: every new row count of the packed projections compiled new primitives, kept in caches of 1024 entries
(see :mod:`spinwheel.engine.kernels.cpu_forward`). These tests pin the fix (row buckets, bounded caches) and that the
engine's own per-request state does not outlive its requests.
"""

import json
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.engine.kernels import cpu_forward
from spinwheel.server.output_deltas import DeltaEncoder

ROOT = Path(__file__).resolve().parents[1]
KINDS = {  # SamplingParams fields of each kind of request
    "n": {"n": 3},
    "beam": {"use_beam_search": True, "n": 2, "temperature": 0.0},
    "logprobs": {"logprobs": 3, "prompt_logprobs": 2},
    "bias": {"logit_bias": {5: 4.0}},
    "stop": {"stop": ["e", "xy"], "n": 2},  # incrementally decoded text, per sequence
    "too long": {"max_tokens": 500},  # rejected at once: more than the model's context
    "bad id": {},  # a prompt token outside the vocabulary
}
PROMPTS = ["12+34=", "hello there", "The quick brown fox jumps over", "a" * 40, "7*8=", "once upon a time, "]


def test_bucket_rows_pads_at_most_an_eighth_and_bounds_the_shapes():
    rows = [cpu_forward.bucket_rows(m) for m in range(1, 2305)]
    assert rows[:16] == list(range(1, 17))
    assert all(m <= b <= m * 1.125 for m, b in zip(range(1, 2305), rows))
    assert (
        rows[16:20] == [18, 18, 20, 20] and cpu_forward.bucket_rows(65) == 72 and cpu_forward.bucket_rows(2049) == 2304
    )
    assert len(set(rows)) == 16 + 7 * 8 + 1  # exact to 16, then 8 per power of two: 17-32, ..., 1025-2048, 2304


def test_packed_projection_on_bucketed_rows_matches_linear():
    if not cpu_forward.onednn_linear_available():
        pytest.skip("no oneDNN packed linear in this PyTorch build")
    torch.manual_seed(0)
    lin = nn.Linear(24, 40)
    packed = cpu_forward._Packed([lin])
    packed.pack()
    for m in (1, 16, 17, 33, 100):  # 17 -> 18, 33 -> 36, 100 -> 104 rows
        x, residual = torch.randn(m, 24), torch.randn(m, 40)
        with torch.no_grad():
            ref = F.linear(x, lin.weight, lin.bias)
        out = packed(x)
        assert out.shape == (m, 40) and out.is_contiguous()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.add_to(x, residual), ref + residual, rtol=1e-5, atol=1e-5)


# A fresh process (oneDNN reads its cache capacities once, at its first primitive): the soak's request mix for a
# fixed number of steps, RSS after a warm-up and at the end.
_SOAK_MIX = """
import json, random, sys
import torch
from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.engine.kernels.cpu_forward import bound_primitive_caches
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
torch.set_num_threads(1)
kw, prompts, steps = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
engine = LLMEngine.from_pretrained("test", EngineConfig(block_size=8, num_kv_blocks=48, **kw))
rng, live, first = random.Random(0), set(), 0.0
for step in range(steps):
    while len(live) < 10:
        p = dict(max_tokens=rng.randint(8, 48), temperature=rng.choice([0, 0.8]), n=rng.randint(1, 3))
        rid = str(rng.random())
        engine.add_request(rid, rng.choice(prompts) * rng.randint(1, 2), SamplingParams(**p))
        live.add(rid)
    for out in engine.step():
        if out.finished:
            live.discard(out.request_id)
    if step == steps // 5:
        first = rss()
print(json.dumps(dict(first=first, last=rss(), applied=bound_primitive_caches(engine.config.onednn_cache_capacity),
                      other=bound_primitive_caches(engine.config.onednn_cache_capacity + 1))))
"""


def _soak_mix(steps: int, **config) -> dict:
    cmd = [sys.executable, "-c", _SOAK_MIX, json.dumps(config), json.dumps(PROMPTS), str(steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_engine_rss_stays_flat_over_many_batch_shapes():
    """Hundreds of distinct batch sizes (decodes of 1-30 sequences plus prefill chunks): with oneDNN's default
    caches RSS grew ~130 MiB over the last 2000 of these steps; with row buckets and bounded caches ~13 MiB."""
    if not cpu_forward.onednn_linear_available():
        pytest.skip("no oneDNN packed linear in this PyTorch build")
    got = _soak_mix(2500)
    assert got["applied"] and not got["other"]  # set before the first primitive; too late for another value
    assert got["last"] - got["first"] < 40, got


def _round(engine: LLMEngine, encoder: DeltaEncoder, seed: int) -> None:
    """60 requests, six of each kind in turn, some aborted soon after; then drain."""
    rng = random.Random(seed)
    for i in range(60):
        kind = list(KINDS)[i % len(KINDS)]
        params = dict(max_tokens=rng.randint(4, 24), temperature=rng.choice([0.0, 0.8]))
        params |= KINDS[kind]
        prompt = [10**6] if kind == "bad id" else rng.choice(PROMPTS)
        engine.add_request(f"{seed}-{i}", prompt, SamplingParams(**params))
        if i % 4 == 3:  # a few steps in between, then abort whatever an earlier request is doing
            _step(engine, encoder)
            engine.abort(f"{seed}-{i - rng.randint(0, 3)}")
    while engine.has_unfinished_requests():
        _step(engine, encoder)


def _step(engine: LLMEngine, encoder: DeltaEncoder) -> None:
    """One step, its groups both encoded as the engine process does and built into outputs (with their text) as
    the engine on a thread does."""
    for group in engine.step_groups():
        encoder.encode(group)
        engine.output_processor.request_output(group)


@pytest.mark.slow
def test_engine_forgets_finished_rejected_and_aborted_requests():
    """Every kind of request the soak sends, aborted anywhere (waiting, running, swapped), in both preemption
    modes: once drained, no per-request state remains, and a second identical round allocates no Python memory
    that outlives it."""
    for mode in ("recompute", "swap"):
        engine = LLMEngine.from_pretrained(
            "test", EngineConfig(block_size=8, num_kv_blocks=24, num_cpu_blocks=24, preemption_mode=mode)
        )
        encoder = DeltaEncoder(engine.output_processor)
        _round(engine, encoder, 0)
        tracemalloc.start()
        _round(engine, encoder, 1)
        before = tracemalloc.take_snapshot()
        _round(engine, encoder, 1)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
        bm, sch = engine.block_manager, engine.scheduler
        assert not engine._groups and not engine._aborted and not len(encoder) and not engine.output_processor._texts
        assert not (sch.waiting or sch.running or sch.swapped or sch._rejected)
        assert not (bm.block_tables or bm.cpu_block_tables or bm._hashes) and bm.num_used_blocks == 0
        assert sch.num_preemptions > 0, "the pool should be small enough to preempt"
        assert grown < 64 * 1024, f"{mode}: a round of 60 requests kept {grown} bytes of Python objects"


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc")
def test_cpu_kv_pool_is_sized_from_the_model_and_committed_as_blocks_are_used():
    """The pool's blocks: the model's bytes per block (2 x layers x block_size x KV heads x head_dim x 4) into the
    budget, or what max_num_seqs x max_model_len needs when that is less. On CPU a 256 MiB pool adds next to
    nothing to RSS until blocks are written (torch.zeros would add all of it); greedy output is the same as on a
    pool of exactly the blocks used, and the blocks never used still read zero."""
    from helpers import tiny_engine_model

    model = tiny_engine_model(4096)
    per_block = 2 * 2 * 16 * 2 * 8 * 4  # layers, block size, KV heads, head_dim 32 / 4
    small = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_model_len=100))
    assert small.runner.num_blocks == 4 * 7 and small.runner.block_bytes == per_block
    before = _rss_mib()
    engine = LLMEngine(model, None, EngineConfig(kv_cache_memory_mb=256, max_model_len=4096))
    assert engine.runner.num_blocks == 256 * 2**20 // per_block and engine.runner.lazy_kv
    assert _rss_mib() - before < 32, "the KV pool's pages were written at start"
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        small.add_request(str(i), p, params)
    outs = {}
    for e in (engine, small):
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    outs.setdefault(o.request_id, []).append(o.outputs[0].token_ids)
    assert all(a == b for a, b in outs.values()) and len(outs) == 3
    touched = engine.block_manager.gpu.touched
    assert 0 < touched <= 3 * 4
    assert not any(c[touched:].any() for c in engine.runner.k_caches + engine.runner.v_caches)
