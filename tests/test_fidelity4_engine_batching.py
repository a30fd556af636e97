"""Two engine mechanisms the seed describes, each in a test of its own.

* **Iteration-level scheduling** (Yu et al., "Orca", OSDI 2022, §3.1): requests join a running batch at the next
  iteration after they arrive and leave it at the iteration their last token is sampled — not at batch boundaries.
  Four requests added at iterations 0, 3 and 5 run in exactly the iterations [arrival, arrival + max_tokens − 1],
  sharing batches of 1 to 4 sequences; each one's greedy tokens equal its own greedy run alone
  (:func:`spinwheel.models.generate.generate`, the dense reference).
* **Copy-on-write of a partly filled last block** under parallel sampling (Kwon et al., SOSP 2023, §4.4, Fig. 8): the
  n samples of a 13-token prompt (blocks of 8: one full block, one holding 5 tokens) share both blocks after the
  prompt (reference count n); the step that writes their first sampled tokens copies the shared partial block n − 1
  times (the last writer keeps it), while the full block stays shared. Free blocks are poisoned every step, so a
  copy that were not made (or made late) would show in the numbers: every sample's log-probs equal a dense forward
  of its own prompt + tokens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_engine_model

from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.models.generate import generate

BLOCK = 8


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(128)


def _prompt(i: int, n: int) -> list[int]:
    return [(13 * i + 7 * j) % 90 + 3 for j in range(n)]


def _recording(engine: LLMEngine) -> list:
    """The scheduler outputs of every iteration, as they are made."""
    outputs, schedule = [], engine.scheduler.schedule

    def recorded():
        outputs.append(schedule())
        return outputs[-1]

    engine.scheduler.schedule = recorded
    return outputs


def _poison_free_blocks(engine: LLMEngine) -> None:
    free = list(engine.block_manager.gpu._free)
    if free:
        for cache in engine.runner.k_caches + engine.runner.v_caches:
            cache[free] = 1e3


# request -> (iteration it is added before, prompt length, max_tokens)
ARRIVALS = {"A": (0, 11, 12), "B": (3, 6, 4), "C": (5, 17, 6), "D": (5, 4, 3)}


def test_requests_join_and_leave_at_iterations(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False))
    outputs = _recording(engine)
    tokens, finished_at, iteration = {}, {}, 0
    while iteration == 0 or engine.has_unfinished_requests():
        for rid, (at, p, g) in ARRIVALS.items():
            if at == iteration:
                engine.add_request(
                    rid, _prompt(ord(rid), p), SamplingParams(temperature=0, max_tokens=g, ignore_eos=True)
                )
        for out in engine.step():
            if out.finished:
                tokens[out.request_id], finished_at[out.request_id] = out.outputs[0].token_ids, iteration
        _poison_free_blocks(engine)
        iteration += 1
    batches = [{s.group.request_id for s in out.scheduled} for out in outputs]
    for rid, (at, _, g) in ARRIVALS.items():
        ran = [i for i, b in enumerate(batches) if rid in b]
        assert ran == list(range(at, at + g)), (rid, ran)  # joins at its arrival, one token per iteration
        assert finished_at[rid] == at + g - 1  # and leaves the batch the iteration it finishes
    assert [len(b) for b in batches] == [1, 1, 1, 2, 2, 4, 4, 3, 2, 2, 2, 1]
    for rid, (_, p, g) in ARRIVALS.items():
        (alone,) = generate(model, [_prompt(ord(rid), p)], g, eos_id=None)
        assert tokens[rid] == alone, rid


def _dense_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).float()[0], -1)  # (P + G, V)
    return logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_parallel_samples_copy_the_partly_filled_last_block(model):
    n, prompt = 3, _prompt(1, 13)  # 13 tokens: block 0 full, block 1 holds 5 of 8
    engine = LLMEngine(model, None, EngineConfig(block_size=BLOCK, num_kv_blocks=32, enable_prefix_caching=False))
    outputs = _recording(engine)
    params = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=0)
    engine.add_request("r", prompt, params)
    bm = engine.block_manager

    engine.step()  # the prompt: its first tokens sampled, n − 1 forks sharing its blocks
    (group,) = engine.scheduler.running
    tables = [list(bm.block_tables[s.seq_id]) for s in group.seqs]
    assert len(tables) == n and all(t == tables[0] for t in tables) and len(tables[0]) == 2
    full, partial = tables[0]
    assert (bm.gpu.blocks[full].ref_count, bm.gpu.blocks[partial].ref_count) == (n, n)
    _poison_free_blocks(engine)

    engine.step()  # each sample writes its first sampled token's K/V into the partial block
    assert outputs[-1].blocks_to_copy and {src for src, _ in outputs[-1].blocks_to_copy} == {partial}
    assert len(outputs[-1].blocks_to_copy) == n - 1  # the last writer keeps the original
    tables = [list(bm.block_tables[s.seq_id]) for s in group.seqs]
    assert all(t[0] == full for t in tables) and bm.gpu.blocks[full].ref_count == n  # the full block stays shared
    lasts = {t[1] for t in tables}
    assert len(lasts) == n and partial in lasts and all(bm.gpu.blocks[b].ref_count == 1 for b in lasts)
    assert bm.num_used_blocks == 1 + n

    final = None
    while engine.has_unfinished_requests():
        _poison_free_blocks(engine)
        for out in engine.step():
            final = out
    samples = final.outputs
    assert len({tuple(s.token_ids) for s in samples}) == n  # the samples really differ
    for s in samples:
        got = torch.tensor([lp[t] for lp, t in zip(s.logprobs, s.token_ids)])
        torch.testing.assert_close(got, _dense_logprobs(model, prompt, s.token_ids), rtol=1e-4, atol=1e-4)
    assert bm.num_used_blocks == 0
