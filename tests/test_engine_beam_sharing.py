"""Beam search in the engine shares KV blocks by reference count (Kwon et al. 2023, §4.4, Fig. 9): the beams forked
from one sequence hold the same physical blocks, each block's reference count is the number of block tables holding
it, a beam writing into a shared block gets a private copy first (copy-on-write), and every block returns to the free
pool once the search ends."""

from collections import Counter

import pytest
from helpers import tiny_engine_model

from spinwheel.engine import EngineConfig, LLMEngine, SamplingParams
from spinwheel.engine.sequence import SequenceStatus


@pytest.fixture(scope="module")
def model():
    return tiny_engine_model(128)


def _record_steps(engine: LLMEngine) -> list[tuple]:
    """Record, as each step runs (after scheduling, before the beams advance): its copy-on-write copies, every
    block table, the reference count of every block in them, the number of free blocks, the sequences it computes."""
    bm, run, steps = engine.block_manager, engine.runner.run, []

    def spy(out):
        tables = {s: list(t) for s, t in bm.block_tables.items()}
        refs = {b: bm.gpu.blocks[b].ref_count for t in tables.values() for b in t}
        computed = {s.seq.seq_id for s in out.scheduled}
        steps.append((list(out.blocks_to_copy), tables, refs, bm.num_free_blocks, computed))
        return run(out)

    engine.runner.run = spy
    return steps


def _drain(engine: LLMEngine, max_steps: int = 200) -> None:
    for _ in range(max_steps):  # a bound, so that broken accounting fails instead of hanging
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError(f"not drained in {max_steps} steps: {engine.stats()}")


def test_beams_share_prompt_blocks_by_reference_count_and_copy_a_shared_last_block_on_write(model):
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=False))
    bm = engine.block_manager
    steps = _record_steps(engine)
    prompt = list(range(10, 20))  # 10 tokens: two full blocks and two tokens in a third
    engine.add_request("b", prompt, SamplingParams(n=4, use_beam_search=True, max_tokens=10, ignore_eos=True))

    engine.step()  # prefill; the first beam step forks the prompt sequence into 4 beams
    beams = engine._groups["b"].seqs_with(SequenceStatus.RUNNING)
    tables = [bm.block_tables[b.seq_id] for b in beams]
    assert len(beams) == 4 and all(t == tables[0] for t in tables), tables  # the same physical blocks
    assert [bm.gpu.blocks[b].ref_count for b in tables[0]] == [4, 4, 4]  # one reference per sharer
    assert bm.num_used_blocks == 3
    prompt_blocks, last = tables[0][:2], tables[0][2]

    engine.step()  # every beam writes its token into the shared last block: three copies, the fourth keeps it
    copies, tables_then, refs, _, _ = steps[-1]
    assert [src for src, _ in copies] == [last] * 3, copies
    fresh = {dst for _, dst in copies}
    assert len(fresh) == 3 and not fresh & {last, *prompt_blocks}  # new blocks
    assert sorted(t[2] for t in tables_then.values()) == sorted(fresh | {last})
    assert all(refs[t[2]] == 1 for t in tables_then.values())  # each beam's last block is its own
    assert all(t[:2] == prompt_blocks for t in tables_then.values()) and refs[prompt_blocks[0]] == 4

    _drain(engine)
    assert len(steps) > 4 and sum(len(s[0]) for s in steps) > 3  # later forks copied again
    for _, tables_then, refs, free, computed in steps:  # every step: references == sharers, the prompt shared by all
        assert set(tables_then) == computed  # only running beams hold blocks: a beam not chosen freed its own
        assert refs == Counter(b for t in tables_then.values() for b in t)
        assert all(t[:2] == prompt_blocks for t in tables_then.values())
        assert free == bm.gpu.num_blocks - len(refs)  # a shared block is used once, whatever its sharers
    assert not bm.block_tables and bm.num_free_blocks == bm.gpu.num_blocks  # every block back in the pool
    assert all(bm.gpu.blocks[b].ref_count == 0 for b in range(bm.gpu.num_blocks))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_beams_share_again_after_swap_or_recompute(model, mode):
    """A beam group preempted while its beams share the prompt comes back still sharing it: a swap moves each shared
    block once (the CPU copies are shared the same way), a recompute computes the shared blocks once for all beams."""
    engine = LLMEngine(
        model,
        None,
        EngineConfig(
            block_size=4, num_kv_blocks=24, num_cpu_blocks=24, preemption_mode=mode, enable_prefix_caching=False
        ),
    )
    bm, run, seen = engine.block_manager, engine.runner.run, Counter()

    def spy(out):
        for tables, pool, where in ((bm.block_tables, bm.gpu, "device"), (bm.cpu_block_tables, bm.cpu, "cpu")):
            holders = Counter(b for t in tables.values() for b in t)
            assert all(pool.blocks[b].ref_count == n for b, n in holders.items())  # references == sharers
            group = engine._groups.get("beams")
            beams = [tables[s.seq_id] for s in group.seqs if s.seq_id in tables] if group else []
            if len(beams) > 1:
                assert all(t[:2] == beams[0][:2] for t in beams), beams  # the prompt's blocks, shared
                seen[where] += 1
                seen["recomputed"] += any(s.group is group and s.num_new_tokens > 1 for s in out.scheduled)
        return run(out)

    engine.runner.run = spy
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("greedy", [(7 * j) % 90 + 3 for j in range(50)], greedy)  # grows into the beams' blocks
    engine.add_request(
        "beams", list(range(10, 20)), SamplingParams(n=4, use_beam_search=True, max_tokens=12, ignore_eos=True)
    )
    _drain(engine)
    assert engine.scheduler.num_preemptions > 0, seen
    assert seen["cpu" if mode == "swap" else "recomputed"] > 0, seen
    assert not bm.block_tables and bm.num_free_blocks == bm.gpu.num_blocks and bm.cpu.num_free == bm.cpu.num_blocks
