"""PagedAttention against Orca's reservation (Kwon et al., SOSP 2023, §3 and §6): on a fixed KV pool, paging admits
the batch the prompts' blocks fit, reservation only the batch whose prompt + max_tokens fit — a larger batch and fewer
iterations for the same tokens, on a small deterministic mixed-length workload.

The arithmetic of the pool (block size b, P blocks, requests in arrival order with prompt p_i and max_tokens g_i,
prefix caching off): the first iteration admits, first come first served,

* reserved: the longest prefix k with Σ_{i<k} ⌈(p_i + g_i)/b⌉ ≤ P (the reservation is all of a request's blocks);
* paged: the longest prefix k with Σ_{i<k} ⌈p_i/b⌉ ≤ P (later blocks are taken as tokens need them).

Both runs are greedy and produce the same tokens; the reserved run never preempts and always holds exactly its
reservations, the paged one reads fewer iterations for all of them.
"""

from __future__ import annotations

import pytest
from helpers import tiny_engine_model

from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams

BLOCK, POOL = 8, 28
PROMPTS = [5, 31, 12, 40, 7, 22, 16, 9, 27, 3, 18, 35]
MAX_TOKENS = [24, 9, 40, 16, 33, 12, 28, 40, 8, 20, 36, 14]


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(128)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _fcfs_prefix(sizes: list[int]) -> int:
    total = 0
    for k, size in enumerate(sizes):
        total += size
        if total > POOL:
            return k
    return len(sizes)


def run(model, allocation: str) -> dict:
    config = EngineConfig(
        block_size=BLOCK,
        num_kv_blocks=POOL,
        enable_prefix_caching=False,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        kv_allocation=allocation,
    )
    engine = LLMEngine(model, None, config)
    for i, (p, g) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        prompt = [(11 * i + 5 * j) % 90 + 3 for j in range(p)]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=g, ignore_eos=True))
    sched, batches, held = engine.scheduler, [], []
    schedule = sched.schedule

    def counted():
        out = schedule()
        batches.append(len(out.scheduled))
        running = [g for g in sched.running if not g.is_finished]
        held.append((engine.block_manager.num_used_blocks, running))
        return out

    sched.schedule = counted
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    reservations = [
        (used, sum(_blocks(len(g.prompt_token_ids) + g.params.max_tokens) for g in running)) for used, running in held
    ]
    return dict(batches=batches, tokens=tokens, preemptions=sched.num_preemptions, reservations=reservations)


@pytest.fixture(scope="module")
def runs(model) -> dict:
    return {allocation: run(model, allocation) for allocation in ("paged", "reserved")}


def test_first_batch_is_the_pool_arithmetic(runs):
    reserved = _fcfs_prefix([_blocks(p + g) for p, g in zip(PROMPTS, MAX_TOKENS)])
    paged = _fcfs_prefix([_blocks(p) for p in PROMPTS])
    assert (reserved, paged) == (5, 11)  # the workload's figures, worked out by hand from the lists above
    assert runs["reserved"]["batches"][0] == reserved
    assert runs["paged"]["batches"][0] == paged
    assert max(runs["paged"]["batches"]) >= 2 * max(runs["reserved"]["batches"])


def test_reservation_holds_every_block_up_front_and_never_preempts(runs):
    reserved = runs["reserved"]
    assert reserved["preemptions"] == 0
    for used, booked in reserved["reservations"]:
        assert used == booked  # exactly the reservations of the running requests, from their first iteration


def test_paging_finishes_the_same_tokens_in_fewer_iterations(runs):
    paged, reserved = runs["paged"], runs["reserved"]
    assert paged["tokens"] == reserved["tokens"] and len(paged["tokens"]) == len(PROMPTS)
    assert all(len(paged["tokens"][str(i)]) == g for i, g in enumerate(MAX_TOKENS))
    # the same tokens computed: throughput per iteration is inversely the number of iterations
    assert len(paged["batches"]) < 0.8 * len(reserved["batches"]), (len(paged["batches"]), len(reserved["batches"]))


def test_reserved_mode_refuses_parallel_sampling_in_one_line(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=BLOCK, num_kv_blocks=POOL, kv_allocation="reserved"))
    engine.add_request("n2", [5, 6, 7], SamplingParams(n=2, max_tokens=4))
    (out,) = engine.step()
    assert out.finished and "kv_allocation='paged'" in out.error
    with pytest.raises(ValueError, match="kv_allocation must be 'paged' or 'reserved'"):
        EngineConfig(kv_allocation="orca")
