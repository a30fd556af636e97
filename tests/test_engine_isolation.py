"""One request, one failure (issue 28, item 1): an exception raised while the engine step processes one request —
its beam-search step, its sampling parameters, its stop check, its prompt logprobs — finishes that request with
"error" and frees its blocks; the other requests in the same steps finish with exactly the tokens they get alone.
Before the fix the exception left ``LLMEngine.step`` and the server failed every request in flight."""

import math

import pytest

import spinwheel
from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.engine.isolation import INTERNAL_ERROR
from spinwheel.engine.sampling_params import SamplingParamsError


def _engine(**config) -> LLMEngine:
    model = spinwheel.load_model("test", vocab_size=100, seed=5)
    return LLMEngine(model, spinwheel.Tokenizer.char_level(), EngineConfig(num_kv_blocks=96, block_size=4, **config))


# The bystanders: greedy, seeded sampling with n=2 and logprobs, and a beam search; their tokens must not depend
# on what else runs.
NORMAL = {
    "greedy": ("12+34=", lambda: SamplingParams(max_tokens=12, temperature=0)),
    "seeded": ("hello", lambda: SamplingParams(max_tokens=10, n=2, seed=7, logprobs=2, temperature=0.9)),
    "beams": ("The quick", lambda: SamplingParams(max_tokens=8, n=2, use_beam_search=True)),
}


def _poison(kind: str) -> SamplingParams:
    """Parameters that raise inside the step, set after construction so that SamplingParams' checks are bypassed
    (what a future bug or an unchecked path would let through)."""
    if kind == "beam search":
        params = SamplingParams(max_tokens=8, n=2, use_beam_search=True)
        params.length_penalty = 700.0  # OverflowError in the beam score
    elif kind == "sampling":
        params = SamplingParams(max_tokens=8, temperature=0.8, seed=1)
        params.logit_bias = {5: "boom"}  # not a number: the batched sampler raises building its bias tensor
    elif kind == "prompt logprobs":
        params = SamplingParams(max_tokens=8, prompt_logprobs=1)
        params.prompt_logprobs = "3"  # not an int: comparing it raises
    else:
        params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[5])
    return params


def _run(engine: LLMEngine, poison: str | None) -> dict:
    for rid, (prompt, make) in NORMAL.items():
        engine.add_request(rid, prompt, make())
    if poison is not None:
        engine.add_request("poisoned", "hi there", _poison(poison))
    final = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return final


@pytest.mark.parametrize("kind", ["beam search", "sampling", "prompt logprobs", "the stop check"])
def test_a_request_that_raises_fails_alone(kind, monkeypatch):
    alone = _run(_engine(), None)
    engine = _engine()
    if kind == "the stop check":  # a stop check that raises for one request only
        check = engine.output_processor.check_stop

        def check_stop(seq, params):
            if params.stop_token_ids == [5]:
                raise RuntimeError("stop check exploded")
            check(seq, params)

        monkeypatch.setattr(engine.output_processor, "check_stop", check_stop)
    final = _run(engine, kind)
    bad = final.pop("poisoned")
    assert bad.error is not None and bad.error.startswith(INTERNAL_ERROR) and kind in bad.error, bad.error
    assert {c.finish_reason for c in bad.outputs} == {"error"}
    assert set(final) == set(NORMAL)
    for rid, out in final.items():
        assert out.error is None
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone[rid].outputs], rid
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
            [c.cumulative_logprob for c in alone[rid].outputs], abs=1e-5
        )
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and not bm.block_tables and not bm.cpu_block_tables
    # the engine serves on: a request after the failure runs as it would alone
    prompt, make = NORMAL["greedy"]
    engine.add_request("after", prompt, make())
    (after,) = [o for _ in range(50) for o in engine.step() if o.finished]
    assert after.outputs[0].token_ids == alone["greedy"].outputs[0].token_ids


def test_two_failing_requests_in_one_batched_sampler_call_fail_alone():
    """The batched sampler call raises; per-request calls find both culprits and sample the rest."""
    engine = _engine()
    for rid, (prompt, make) in NORMAL.items():
        engine.add_request(rid, prompt, make())
    for rid in ("bad1", "bad2"):
        engine.add_request(rid, "hi", _poison("sampling"))
    final = {o.request_id: o for _ in range(500) for o in engine.step() if o.finished}
    assert final["bad1"].error and final["bad2"].error
    assert all(final[rid].error is None for rid in NORMAL)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("value", [700.0, 1e308, -math.inf, math.inf, math.nan, -700.0, 10.5])
def test_sampling_params_refuse_an_unbounded_length_penalty(value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(n=2, use_beam_search=True, length_penalty=value)
    assert e.value.param == "length_penalty" and "[-10, 10]" in str(e.value)
    SamplingParams(n=2, use_beam_search=True, length_penalty=-10.0)  # the bounds themselves are fine


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
def test_sampling_params_refuse_infinite_values(name):
    with pytest.raises(SamplingParamsError, match="finite"):
        SamplingParams(**{name: math.inf})


def test_logprobs_above_the_vocabulary_mean_all_of_it():
    """``logprobs`` / ``prompt_logprobs`` larger than the vocabulary used to raise inside the step (topk)."""
    engine = _engine()
    engine.add_request("r", "hi", SamplingParams(max_tokens=2, temperature=0, logprobs=1000, prompt_logprobs=1000))
    (out,) = [o for _ in range(20) for o in engine.step() if o.finished]
    assert out.error is None
    assert len(out.outputs[0].logprobs[0]) == 100 and len(out.prompt_logprobs[1]) == 100


def test_a_request_failing_while_its_samples_fork_frees_every_block(monkeypatch):
    """n = 3 forks two samples off the prompt sequence; the second fork raises. The first fork's blocks are
    already the group's, so failing the request frees them too."""
    alone = _run(_engine(), None)
    engine = _engine()
    fork, calls = engine.block_manager.fork, []

    def flaky_fork(parent, child, *args):
        calls.append(child)
        if len(calls) == 2:
            raise RuntimeError("fork failed")
        fork(parent, child, *args)

    monkeypatch.setattr(engine.block_manager, "fork", flaky_fork)
    engine.add_request("forking", "hi there", SamplingParams(max_tokens=6, n=3, temperature=0))
    final = _run(engine, None)
    assert final.pop("forking").error.startswith(INTERNAL_ERROR)
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in final.items()} == {
        rid: [c.token_ids for c in o.outputs] for rid, o in alone.items()
    }
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and not bm.block_tables


@pytest.mark.parametrize("length_penalty", [-10.0, -5.0])
def test_beam_search_with_a_negative_length_penalty_returns_n_hypotheses(length_penalty):
    """Scores of a negative length penalty fell below the -1e9 that stood for "no hypothesis yet": the search
    stopped with none and the server answered 200 with no choices."""
    engine = _engine()
    params = SamplingParams(n=3, use_beam_search=True, length_penalty=length_penalty, max_tokens=40)
    engine.add_request("b", "hello", params)
    (out,) = [o for _ in range(100) for o in engine.step() if o.finished]
    assert len(out.outputs) == 3 and all(c.finish_reason in ("stop", "length") for c in out.outputs)
    assert [c.score for c in out.outputs] == sorted((c.score for c in out.outputs), reverse=True)


def test_a_request_whose_output_cannot_be_built_fails_alone(monkeypatch):
    """``LLMEngine.step`` builds every request's output (its text): one that raises there ends that request."""
    alone = _run(_engine(), None)
    engine = _engine()
    build = engine.output_processor.request_output

    def request_output(group):
        if group.request_id == "poisoned" and group.seqs[0].num_output_tokens >= 2:
            raise UnicodeError("cannot decode this one")
        return build(group)

    monkeypatch.setattr(engine.output_processor, "request_output", request_output)
    final = _run(engine, "the stop check")  # a plain greedy request, whose output raises from its second token
    bad = final.pop("poisoned")
    assert bad.outputs == [] and "building its output" in bad.error and "UnicodeError" in bad.error
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in final.items()} == {
        rid: [c.token_ids for c in o.outputs] for rid, o in alone.items()
    }
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and not bm.block_tables
