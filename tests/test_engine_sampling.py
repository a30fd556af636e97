"""Sampling, parallel samples, logprobs, stops, streaming/abort and weight updates of the engine."""

import pytest
import torch
from helpers import tiny_engine_model

from spinwheel.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from spinwheel.models import ModelConfig, Tokenizer, Transformer


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(256)


def _dense_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]), attn_metadata=None)[0].float(), dim=-1)


def test_parallel_samples_share_prompt_blocks_and_are_seed_reproducible(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=4))
    prompt = list(range(10, 30))  # 5 full blocks
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=6)
    engine.add_request("a", prompt, params)
    engine.step()  # prefill + fork + first tokens
    group = engine._groups["a"]
    assert len(group.seqs) == 4
    bm = engine.block_manager
    tables = [list(bm.block_tables[s.seq_id]) for s in group.seqs]
    assert all(t == tables[0] for t in tables)  # all prompt blocks shared
    assert all(bm.gpu.blocks[b].ref_count == 4 for b in tables[0])
    logical, physical = bm.sharing()
    assert (logical, physical) == (20, 5)
    engine.step()  # first decode: each sample writes its own new block, prompt blocks stay shared
    assert all(bm.gpu.blocks[b].ref_count == 4 for b in tables[0])
    bm.check_invariants()
    while engine.has_unfinished_requests():
        outs = engine.step()
    first = [o.token_ids for o in outs[0].outputs]
    assert len({tuple(t) for t in first}) > 1  # the samples differ
    assert bm.num_free_blocks == bm.gpu.num_blocks
    # same seed -> same samples, whether alone or in a batch with other requests
    llm = LLM(model)
    alone = llm.generate([prompt], params)[0]
    mixed = llm.generate(
        [list(range(40, 70)), prompt, [5, 6]],
        [SamplingParams(n=3, temperature=0.8), params, SamplingParams(temperature=1.0)],
    )[1]
    assert [o.token_ids for o in alone.outputs] == first == [o.token_ids for o in mixed.outputs]


def test_logprobs_and_prompt_logprobs_match_dense_model(model):
    llm = LLM(model, block_size=4, enable_prefix_caching=False)
    prompt = [7, 8, 9, 10, 11, 12, 13]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2))[0]
    comp = out.outputs[0]
    lp = _dense_logprobs(model, prompt + comp.token_ids)
    for i, tok in enumerate(comp.token_ids):
        ref = lp[len(prompt) - 1 + i]
        assert comp.logprobs[i][tok] == pytest.approx(float(ref[tok]), abs=1e-5)
        assert len(comp.logprobs[i]) == 3  # greedy token is the top-1
        top = ref.topk(3).indices.tolist()
        assert sorted(comp.logprobs[i]) == sorted(top)
    assert comp.cumulative_logprob == pytest.approx(
        sum(float(lp[len(prompt) - 1 + i][t]) for i, t in enumerate(comp.token_ids)), abs=1e-4
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert out.prompt_logprobs[pos][prompt[pos]] == pytest.approx(float(lp[pos - 1][prompt[pos]]), abs=1e-5)


def test_truncation_and_penalties(model):
    llm = LLM(model)
    prompt = [20, 21, 22, 23]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    for p in (
        SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, seed=1),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, seed=1),
    ):
        assert llm.generate([prompt], p)[0].outputs[0].token_ids == greedy
    # a huge frequency/presence penalty forbids repeats among the outputs
    out = (
        llm.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=12, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(out) == 12
    rep = (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1e4, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(rep)) == len(rep) and not set(rep) & set(prompt)


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 1e-6])
def test_tiny_temperatures_sample_greedily(model, temperature):
    # logits / 1e-38 overflowed to inf (1e-300 is 0 in float32): NaN probabilities, argmax 0 = <pad> every time
    llm = LLM(model)
    prompt = [20, 21, 22, 23]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    tiny = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)
    # alone, with a seed, and batched with a row sampled at temperature 1
    outs = llm.generate(
        [prompt, prompt, [5, 6, 7]],
        [
            tiny,
            SamplingParams(temperature=temperature, seed=3, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=8, seed=1),
        ],
    )
    for out in outs[:2]:
        assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
        assert out.outputs[0].cumulative_logprob == pytest.approx(greedy.outputs[0].cumulative_logprob, abs=1e-5)
    assert 0 not in greedy.outputs[0].token_ids


def test_stops_min_tokens_and_ignore_eos(model):
    llm = LLM(model)
    prompt = [30, 31, 32]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert len(free.token_ids) == 16 and free.finish_reason == "length"
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_tok], ignore_eos=True)
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    # EOS is masked until min_tokens are out
    model.config.eos_token_id = free.token_ids[0]
    llm2 = LLM(model)
    try:
        eos_stop = llm2.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
        assert eos_stop.token_ids == free.token_ids[:1] and eos_stop.finish_reason == "stop"
        late = llm2.generate([prompt], SamplingParams(temperature=0, max_tokens=16, min_tokens=3))[0].outputs[0]
        assert len(late.token_ids) >= 3 and free.token_ids[0] not in late.token_ids[:3]
    finally:
        model.config.eos_token_id = 2


def test_text_prompts_stop_strings_and_streaming_abort():
    tok = Tokenizer.char_level()
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = Transformer(cfg).init_weights(seed=3, std=0.1)
    llm = LLM(model, tokenizer=tok)
    free = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert free.text == tok.decode(free.token_ids)
    stop = free.text[4:6]
    cut = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))[0]
    assert cut.outputs[0].text == free.text[: free.text.find(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    # streaming: outputs grow one token per step; aborting frees every block
    engine = llm.engine
    engine.add_request("s", "abc", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("t", "xyz", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    lengths = []
    for _ in range(4):
        for o in engine.step():
            if o.request_id == "s":
                lengths.append(len(o.outputs[0].token_ids))
    assert lengths == [1, 2, 3, 4]
    assert engine.abort("s")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["s"].finished and outs["s"].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_update_weights_invalidates_prefix_cache_and_shared_model_still_trains(model):
    m = Transformer(model.config).init_weights(seed=5, std=0.1)
    x = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        before = m(x)
    llm = LLM(m, block_size=4)
    prompt = list(range(40, 60))
    a = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    with torch.no_grad():
        torch.testing.assert_close(m(x), before)  # paged kernel falls back to dense outside the engine
    assert llm.engine.block_manager.gpu._by_hash  # prompt blocks are cached
    other = Transformer(model.config).init_weights(seed=6, std=0.1)
    llm.update_weights(other.state_dict())
    assert not llm.engine.block_manager.gpu._by_hash
    b = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    ref = LLM(other).generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    assert b == ref and a != b
    # the trainer updates the shared model in place, then tells the engine
    with torch.no_grad():
        m.load_state_dict(model.state_dict())
    llm.update_weights(m)
    c = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    assert c == LLM(model).generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids


def test_update_weights_checks_every_tensor_before_loading_any(model):
    """A wrong-shape or unknown tensor is one line and nothing is loaded (not the tensors before it either)."""
    m = Transformer(model.config).init_weights(seed=5, std=0.1)
    llm = LLM(m, block_size=4)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    other = Transformer(model.config).init_weights(seed=6, std=0.1).state_dict()
    bad = {**other, "lm_head.weight": torch.zeros(3, 3)}  # the last name: every other tensor comes first
    with pytest.raises(RuntimeError, match=r"^update_weights: size mismatch for 'lm_head.weight': \(3, 3\) given"):
        llm.update_weights(bad)
    with pytest.raises(KeyError, match="update_weights: unexpected tensor 'layers.9.mlp.up_proj.weight'"):
        llm.update_weights({**other, "layers.9.mlp.up_proj.weight": torch.zeros(1)})
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_requests = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 12), st.sampled_from(["greedy", "n3", "beam2"]), st.integers(0, 6)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=12, deadline=None)
@given(reqs=_requests, mode=st.sampled_from(["recompute", "swap"]), prefix=st.booleans())
def test_engine_accounting_under_random_requests_preemption_and_aborts(model, reqs, mode, prefix):
    engine = LLMEngine(
        model,
        None,
        EngineConfig(
            block_size=4,
            num_kv_blocks=20,
            num_cpu_blocks=12,
            preemption_mode=mode,
            enable_prefix_caching=prefix,
            max_num_batched_tokens=24,
            max_num_seqs=8,
        ),
    )
    aborts = {}
    for i, (plen, max_tokens, kind, abort_at) in enumerate(reqs):
        params = {
            "greedy": SamplingParams(temperature=0, max_tokens=max_tokens),
            "n3": SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=max_tokens),
            "beam2": SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=max_tokens),
        }[kind]
        engine.add_request(str(i), [(7 * i + j) % 50 + 3 for j in range(plen)], params)
        if abort_at:
            aborts[str(i)] = abort_at
    finished = {}
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.block_manager.check_invariants()
    assert not engine.has_unfinished_requests(), "engine did not drain (hang)"
    assert set(finished) == {str(i) for i in range(len(reqs))}
    assert engine.block_manager.num_free_blocks == 20 and engine.block_manager.cpu.num_free == 12
    for out in finished.values():  # every request fits the pool (at most 20 blocks): none may fail
        assert out.error is None, out.error
        assert all(o.finish_reason in ("length", "stop", "abort") for o in out.outputs)


def test_flush_denormal_is_scoped_to_the_step():
    from spinwheel.engine.kernels.denormals import _denormals_flushed, flush_denormal

    assert not _denormals_flushed()
    with flush_denormal(True):
        assert _denormals_flushed()
    assert not _denormals_flushed()  # the caller's setting is back


def test_greedy_kernel_matches_argmax_and_log_softmax():
    """The fused greedy reduction: torch.argmax's first maximum and log_softmax at it, to fp32 rounding; rows with a
    NaN or an infinite maximum are left to PyTorch (None)."""
    from spinwheel.engine.kernels import cpu_kernels

    if cpu_kernels.load_kernels() is None:
        pytest.skip("no C compiler")
    torch.manual_seed(0)
    for v in (5, 16, 49_152, 1000):  # below one vector, one vector, the real vocabulary, a ragged tail
        x = torch.randn(7, v) * 8
        x[1, v // 2] = x[1, v - 1] = x[1].max() + 1  # a tie: the first index wins, as torch.argmax
        x[2] = -1e30  # all equal and very negative
        tokens, lps = cpu_kernels.greedy_rows(x)
        ref = x.argmax(-1)
        assert tokens == ref.tolist()
        assert torch.allclose(torch.tensor(lps), torch.log_softmax(x, -1).gather(1, ref[:, None])[:, 0], atol=2e-6)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(3, 40)
        x[1, 7] = bad
        assert cpu_kernels.greedy_rows(x) is None
    assert cpu_kernels.greedy_rows(torch.randn(2, 40, dtype=torch.float64)) is None


def test_greedy_fast_path_equals_the_general_sampler(model, monkeypatch):
    """Greedy requests without penalties or logprobs take the fused kernel; the tokens and cumulative log-probs are
    the general path's (kernel disabled), and a request that needs the general path still gets it."""
    from spinwheel.engine.sampling import sampler as sampler_module

    prompts = [list(range(10, 30)), [5, 6, 7], list(range(40, 47))]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)

    def run():
        return LLM(model).generate(prompts, [plain, plain, penalised])

    kernel = sampler_module.greedy_rows
    monkeypatch.setattr(sampler_module, "greedy_rows", lambda x: None)
    slow = run()
    calls = []
    monkeypatch.setattr(sampler_module, "greedy_rows", lambda x: calls.append(x.shape[0]) or kernel(x))
    mixed = run()
    assert not calls  # the penalised request shares every step: the general path ran
    fast = LLM(model).generate(prompts[:2], plain) + mixed[2:]
    assert calls == [2] * 8 or kernel(torch.zeros(1, 1)) is None  # one fused call per step (unless no compiler)
    for a, b, c in zip(fast, slow, mixed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-4)
