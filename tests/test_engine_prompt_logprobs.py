"""Prompt logprobs of the engine against Hugging Face ``transformers``: the log-softmax of a full forward's logits
at each prompt position, with the top-k and each token's rank, also under chunked prefill, recompute preemption
and prefix-cache hits (a request that scores its prompt computes all of it; the blocks it writes still serve the
cache)."""

import pytest
import torch
from helpers import TINY_LLAMA_EOS, TINY_LLAMA_VOCAB

from spinwheel.engine import LLM, SamplingParams

VOCAB, EOS, TOP = TINY_LLAMA_VOCAB, TINY_LLAMA_EOS, 3  # the `tiny_llama` checkpoint's (conftest.py)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, VOCAB, (20,), generator=g).tolist()  # 2-5 full blocks shared by the first three
    shared = [prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 13)]
    return shared + [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (2, 9, 31)]


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """(T, V): row t is log p(. | prompt[: t + 1]) from one dense forward."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(out, ref: torch.Tensor, prompt: list[int]) -> None:
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_logprob_ranks[0] is None
    for pos in range(1, len(prompt)):
        row, token, got = ref[pos - 1], prompt[pos], out.prompt_logprobs[pos]
        assert got is not None, f"position {pos} has no prompt logprob"
        assert got[token] == pytest.approx(float(row[token]), abs=2e-5), f"position {pos}"
        top = row.topk(TOP).indices.tolist()
        assert set(got) == set(top) | {token}
        for t in top:
            assert got[t] == pytest.approx(float(row[t]), abs=2e-5)
        assert out.prompt_logprob_ranks[pos] == int((row > row[token]).sum()) + 1


CONFIGS = {
    "default": dict(block_size=8),
    "chunked": dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=4),
    "recompute": dict(block_size=4, num_kv_blocks=14, preemption_mode="recompute"),
    "no_prefix_cache": dict(block_size=8, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logprobs_equal_hf(tiny_llama, prompts, name):
    path, hf = tiny_llama
    llm = LLM(str(path), **CONFIGS[name])
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=TOP, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        _check(out, _hf_logprobs(hf, prompt), prompt)
    sched = llm.engine.scheduler
    if name == "chunked":
        assert sched.num_chunked_prefills > 0
    if name == "recompute":
        assert sched.num_preemptions > 0
    assert llm.stats().num_free_blocks == llm.stats().num_blocks
    llm.engine.block_manager.check_invariants()


def test_a_cached_prefix_still_gives_prompt_logprobs(tiny_llama, prompts):
    path, hf = tiny_llama
    llm = LLM(str(path), block_size=4)
    plain = SamplingParams(temperature=0, max_tokens=4)
    scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP)
    bm = llm.engine.block_manager
    llm.generate(prompts[:1], plain)  # the shared 20-token prefix is now in the cache
    hits = bm.num_prefix_hit_tokens
    outs = llm.generate(prompts[:3], scored)  # would hit the cache; they compute their prompts instead
    assert bm.num_prefix_hit_tokens == hits
    for prompt, out in zip(prompts[:3], outs):
        _check(out, _hf_logprobs(hf, prompt), prompt)
    # what they computed serves later requests, and their outputs equal the cached path's
    again = llm.generate(prompts[1:3], plain)
    assert bm.num_prefix_hit_tokens >= hits + 2 * 20
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[1:]]


def test_prompt_logprobs_with_parallel_samples_and_beams(tiny_llama, prompts):
    # recorded once per request, before the samples (or beams) fork from the prompt sequence
    path, hf = tiny_llama
    llm = LLM(str(path), block_size=4)
    prompt = prompts[4]
    ref = _hf_logprobs(hf, prompt)
    sampled = llm.generate([prompt], SamplingParams(n=3, max_tokens=5, seed=1, prompt_logprobs=TOP))[0]
    beams = llm.generate([prompt], SamplingParams(n=2, use_beam_search=True, max_tokens=5, prompt_logprobs=TOP))[0]
    for out in (sampled, beams):
        _check(out, ref, prompt)
    assert len(sampled.outputs) == 3 and len(beams.outputs) == 2
