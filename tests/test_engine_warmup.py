"""The start-up step of ``spinwheel serve`` (spinwheel.engine.kernels.warmup): one step at the full token budget, then
no
trace of it — no blocks, no cached prefixes, counters and the sampler's seed as before."""

import dataclasses

import pytest
from helpers import tiny_engine_model

from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.engine.kernels.warmup import warm_up, warmup_prompts


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(128)


def _engine(model, **kw):
    return LLMEngine(model, None, EngineConfig(**kw))


def _outputs(engine):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=2),  # unseeded: the engine's generator
    ]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    return done


def test_warm_up_runs_one_full_budget_step_and_leaves_no_trace(model):
    engine = _engine(model, block_size=4, max_num_batched_tokens=300, max_num_seqs=8)
    sizes, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        sizes.append(sum(s.num_new_tokens for s in out.scheduled))
        return out

    engine.scheduler.schedule = recording
    lengths = [len(p) for p in warmup_prompts(engine)]
    assert lengths == [127, 127, 46] and sum(lengths) == 300  # the context is 128 tokens
    before = engine.stats()
    warm_up(engine)
    assert sizes[0] == 300  # the whole budget in one step
    assert engine.stats() == before
    assert engine.block_manager.num_used_blocks == 0
    engine.scheduler.schedule = schedule
    fresh = _engine(model, block_size=4, max_num_batched_tokens=300, max_num_seqs=8)
    assert _outputs(engine) == _outputs(fresh)  # greedy and unseeded samples alike
    counts = lambda e: dataclasses.replace(e.stats(), generation_tokens_per_s=0.0)  # noqa: E731 - a rate is timing
    assert counts(engine) == counts(fresh)


def test_warm_up_prompts_are_not_cached(model):
    engine = _engine(model, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    prompt = warmup_prompts(engine)[0]
    warm_up(engine)
    engine.add_request("again", prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().prefix_cache_hit_rate == 0.0


@pytest.mark.parametrize(
    "kw",
    [
        dict(block_size=64, num_kv_blocks=2),  # a pool of 128 slots: one prompt of 127
        dict(block_size=4, num_kv_blocks=10, max_num_batched_tokens=256),  # the pool, not the budget, decides
        dict(max_num_seqs=2, max_num_batched_tokens=64, enable_chunked_prefill=True),
        dict(enable_chunked_prefill=False, max_num_batched_tokens=128, max_num_seqs=16),
    ],
)
def test_warm_up_fits_any_pool_and_limits(model, kw):
    engine = _engine(model, **kw)
    prompts = warmup_prompts(engine)
    bm = engine.block_manager
    assert 1 <= len(prompts) <= engine.config.max_num_seqs
    assert sum(bm.num_blocks_for(len(p) + 1) for p in prompts) <= bm.gpu.num_blocks
    warm_up(engine)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_prepare_for_serving_fits_the_decode_step_budget_to_the_time_target(model, monkeypatch):
    from spinwheel.engine.kernels import warmup

    def prepare_for_serving(engine, ms, step_s=None):
        if step_s is not None:  # a machine on which the 256-token warm-up step takes step_s seconds
            real = warmup.warm_up
            monkeypatch.setattr(warmup, "warm_up", lambda e: (real(e), step_s)[1])
        try:
            return warmup.prepare_for_serving(engine, ms)
        finally:
            monkeypatch.undo()

    def fitted(ms, step_s=None):
        engine = _engine(model, block_size=4, max_num_batched_tokens=256, max_num_seqs=8)
        line = prepare_for_serving(engine, ms, step_s)
        assert line.startswith("warm-up step of 256 prompt tokens")
        assert engine.block_manager.num_used_blocks == 0
        return engine.config.max_num_batched_tokens_with_decodes

    assert fitted(None) is None  # warm-up only
    assert fitted(1e9) is None  # the whole budget fits: no bound
    assert fitted(0.0) is None  # 0: no bound by definition
    assert fitted(1e-9) == 8  # never below max_num_seqs: every running sequence still decodes
    assert fitted(50.0, step_s=0.1) == 128  # 256 tokens in 100 ms: 128 fit in 50 ms
    assert fitted(150.0, step_s=0.1) is None
    assert fitted(1.0, step_s=0.1) == 8
