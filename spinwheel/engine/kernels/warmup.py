"""A start-up step at the full token budget, as a server runs before it takes requests (vLLM runs a dummy batch of
``max_num_batched_tokens`` when it starts).

The first step of a given size in a fresh process pays costs the later ones do not: the allocator grows and the
kernel zeroes the pages of the largest activations, oneDNN compiles kernels for the new row counts. A server's
first burst of requests is such a step, and its requests' time to first token carried those costs (on the
``small`` preset ~20% of a 24-prompt step offline and more in a server's engine process). :func:`warm_up` runs one
step of dummy prompts filling the budget (as many as the pool and ``max_num_seqs`` hold), then removes every trace
of it: no blocks held, no cached prefixes, counters and the sampler's seed as they were.
"""

from __future__ import annotations

import time

import torch

from spinwheel.engine.llm_engine import LLMEngine
from spinwheel.engine.sampling_params import SamplingParams

WARMUP_PREFIX = "spinwheel-warmup-"


def warmup_prompts(engine: LLMEngine) -> list[list[int]]:
    """Dummy prompts of ``max_num_batched_tokens`` tokens in all (fewer where ``max_num_seqs`` or the KV pool holds
    less), each within the context; distinct random token ids, so that no prefix is shared."""
    config, bm = engine.config, engine.block_manager
    budget = config.max_num_batched_tokens
    longest = max(1, min(budget, engine.max_model_len - 1, bm.gpu.num_blocks * bm.block_size - 1))
    lengths = [longest] * (budget // longest) + ([budget % longest] if budget % longest else [])
    lengths = lengths[: config.max_num_seqs]
    while len(lengths) > 1 and sum(bm.num_blocks_for(n + 1) for n in lengths) > bm.gpu.num_blocks:
        lengths.pop()
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up step on an idle engine; returns the seconds it took."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine")
    parts = getattr(engine, "micro", None) or [engine]  # a pipeline-parallel engine's micro-batches (pp_engine)
    counters = [(engine, ("num_prompt_tokens", "num_generated_tokens"))]
    for part in parts:
        counters.append((part.block_manager, ("num_prefix_queried_tokens", "num_prefix_hit_tokens")))
        counters.append((part.scheduler, ("num_preemptions", "num_swap_outs", "num_chunked_prefills")))
    saved = [(obj, name, getattr(obj, name)) for obj, names in counters for name in names]
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(warmup_prompts(engine)):
        engine.add_request(f"{WARMUP_PREFIX}{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - t0
    for obj, name, value in saved:
        setattr(obj, name, value)
    for part in parts:
        part.block_manager.reset_prefix_cache()
    engine._recent.clear()  # the token rate of the warm-up is not the server's
    engine.sampler._generators.clear()  # unseeded requests draw from the seed's start, as without a warm-up
    engine.last_progress_time = time.monotonic()
    return seconds


def prepare_for_serving(engine: LLMEngine, decode_step_ms: float | None) -> str:
    """Warm ``engine`` up for serving; with ``decode_step_ms``, also size the token budget of a step that decodes
    the way Sarathi-Serve does (Agrawal et al., OSDI 2024: profile, then take what meets the inter-token latency
    target): the warm-up step is timed twice more (the first paid the first-time costs; the faster counts) and
    ``max_num_batched_tokens_with_decodes`` becomes the tokens that fit in ``decode_step_ms`` at that rate — at least
    ``max_num_seqs``; no bound where the whole budget fits, or with ``decode_step_ms`` 0. Returns a line saying what
    it did."""
    seconds = warm_up(engine)
    tokens = sum(len(p) for p in warmup_prompts(engine))
    line = f"warm-up step of {tokens} prompt tokens: {seconds * 1e3:.0f} ms"
    if decode_step_ms is None:
        return line
    seconds = min(warm_up(engine), warm_up(engine))  # the fastest of two: a timing on a shared machine is noisy
    c = engine.config
    fit = int(tokens * decode_step_ms / 1e3 / seconds) if decode_step_ms > 0 else c.max_num_batched_tokens
    c.max_num_batched_tokens_with_decodes = None if fit >= c.max_num_batched_tokens else max(c.max_num_seqs, fit)
    taken = c.max_num_batched_tokens_with_decodes or c.max_num_batched_tokens
    return (
        f"{line} ({seconds * 1e3:.0f} ms warm); a step that also decodes takes at most {taken} tokens "
        f"(--decode-step-ms {decode_step_ms:g})"
    )
