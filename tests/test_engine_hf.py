"""Engine generation against Hugging Face ``generate`` on a random tiny Llama saved as an HF checkpoint:
greedy (plain, forced preemption by recompute and by swap, chunked prefill, prefix caching) and beam search."""

import pytest
import torch
from helpers import TINY_LLAMA_EOS, TINY_LLAMA_VOCAB

from spinwheel.engine import LLM, SamplingParams  # noqa: E402
from spinwheel.engine.kernels.cpu_kernels import load_kernels  # noqa: E402

VOCAB, EOS = TINY_LLAMA_VOCAB, TINY_LLAMA_EOS  # the `tiny_llama` checkpoint's (conftest.py)
MAX_NEW = 20


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    lengths = [1, 3, 5, 8, 12, 16, 17, 21, 26, 31, 33, 40, 47, 52, 60, 64]
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(hf, prompt, max_new=MAX_NEW):
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama, prompts):
    _, hf = tiny_llama
    with torch.no_grad():
        return [_hf_greedy(hf, p) for p in prompts]


def _engine_greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


CONFIGS = {
    "default": dict(),
    "recompute": dict(block_size=4, num_kv_blocks=24, preemption_mode="recompute"),
    "swap": dict(block_size=4, num_kv_blocks=24, preemption_mode="swap", num_cpu_blocks=24),
    "chunked": dict(block_size=8, max_num_batched_tokens=16, max_num_seqs=6),
    "no_prefix_no_chunk": dict(
        enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(tiny_llama, prompts, hf_greedy, name):
    path, _ = tiny_llama
    llm = LLM(str(path), **CONFIGS[name])
    # decodes run in the fused CPU kernel wherever it builds (fp32 on the CPU), so these tests cover it end to end
    assert llm.engine.runner.fused_decode == (load_kernels() is not None)
    got = _engine_greedy(llm, prompts)
    for i, (g, h) in enumerate(zip(got, hf_greedy)):
        assert g == h, f"prompt {i} (len {len(prompts[i])}): {g} != HF {h}"
    stats = llm.stats()
    if name in ("recompute", "swap"):
        assert stats.num_preemptions > 0
    if name == "swap":
        assert llm.engine.scheduler.num_swap_outs > 0
    if name == "chunked":
        assert llm.engine.scheduler.num_chunked_prefills > 0
    assert stats.num_free_blocks == stats.num_blocks  # everything freed
    llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize("name", ["recompute", "swap"])
def test_greedy_parallel_samples_match_hf_under_preemption(tiny_llama, prompts, hf_greedy, name):
    # n = 3 greedy samples on a pool that forces preemption; without the prefix cache a recomputed group computes
    # its shared prompt once (one sequence) and the other two share it again
    path, _ = tiny_llama
    llm = LLM(str(path), **CONFIGS[name], enable_prefix_caching=False)
    outs = llm.generate(prompts[:8], SamplingParams(n=3, temperature=0.0, max_tokens=MAX_NEW))
    for i, out in enumerate(outs):
        assert out.error is None
        assert [o.token_ids for o in out.outputs] == [hf_greedy[i]] * 3, f"prompt {i}"
    assert llm.stats().num_preemptions > 0
    assert llm.stats().num_free_blocks == llm.stats().num_blocks
    llm.engine.block_manager.check_invariants()


def test_greedy_with_prefix_caching_matches_hf(tiny_llama):
    path, hf = tiny_llama
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, VOCAB, (37,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in range(1, 17)]
    with torch.no_grad():
        expected = [_hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(str(path), block_size=8, enable_prefix_caching=True)
    for _ in range(2):  # second round: all prefixes cached
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats().prefix_cache_hit_rate > 0.4


def _hf_beams(hf, prompt, k, max_new, **kw):
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        num_beams=k,
        num_return_sequences=k,
        eos_token_id=kw.pop("eos"),
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        **kw,
    )
    return out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()


def _trim(ids, eos):
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize(
    "kw",
    [
        dict(length_penalty=1.0, early_stopping=False),
        dict(length_penalty=0.5, early_stopping=True),
        dict(length_penalty=2.0, early_stopping="never"),
    ],
)
def test_beam_search_matches_hf(tiny_llama, prompts, hf_greedy, kw):
    path, hf = tiny_llama
    # make EOS a token the model actually likes, so hypotheses finish at different lengths
    counts = torch.bincount(torch.tensor([t for h in hf_greedy for t in h]), minlength=VOCAB)
    eos = int(counts.argmax())
    llm = LLM(str(path), block_size=4)
    llm.engine.eos_ids = {eos}
    k, max_new = 4, 10
    sample = prompts[1::3]
    outs = llm.beam_search(sample, beam_width=k, max_tokens=max_new, **kw)
    saw_eos = False
    for prompt, out in zip(sample, outs):
        with torch.no_grad():
            ref, ref_scores = _hf_beams(hf, prompt, k, max_new, eos=eos, **kw)
        got = [o.token_ids for o in out.outputs]
        assert got == [_trim(r, eos) for r in ref], f"prompt len {len(prompt)}"
        assert [o.score for o in out.outputs] == pytest.approx(ref_scores, abs=1e-4)
        saw_eos |= any(o.finish_reason == "stop" for o in out.outputs)
    assert saw_eos
    assert llm.stats().num_free_blocks == llm.stats().num_blocks
    llm.engine.block_manager.check_invariants()


def test_request_that_can_never_fit_finishes_with_error(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), block_size=4, num_kv_blocks=8, max_model_len=128)
    outs = llm.generate(
        [[5] * 20, [5] * 100, [6] * 4],
        [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40), SamplingParams(max_tokens=4)],
    )
    assert outs[0].outputs[0].finish_reason == "error" and "KV pool" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "error" and "context" in outs[1].error
    assert outs[2].outputs[0].finish_reason == "length" and len(outs[2].outputs[0].token_ids) == 4


def test_greedy_matches_hf_with_many_decode_buckets(tiny_llama, prompts, hf_greedy, monkeypatch):
    from spinwheel.engine import model_runner

    monkeypatch.setattr(model_runner, "DECODE_BUCKET_BYTES", 2 * 2 * 16 * 4 * 40)  # ~40 tokens per bucket
    monkeypatch.setattr(model_runner, "load_kernels", lambda: None)  # the PyTorch path, not the C kernel
    path, _ = tiny_llama
    llm = LLM(str(path), block_size=4)
    assert not llm.engine.runner.fused_decode
    assert len(llm.engine.runner._decode_buckets([10, 20, 30, 40, 50])) > 2
    assert _engine_greedy(llm, prompts) == hf_greedy
