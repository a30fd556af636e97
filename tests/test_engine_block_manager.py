"""Block manager accounting: fork / copy-on-write / free / swap / prefix caching, and hypothesis property tests."""

from hypothesis import given, settings
from hypothesis import strategies as st

from spinwheel.engine.kv.block_manager import AllocStatus, BlockManager


def test_fork_shares_and_copy_on_write_copies_last_block():
    bm = BlockManager(num_blocks=10, num_cpu_blocks=4, block_size=4, enable_prefix_caching=False)
    tokens = list(range(10))  # 3 blocks, the last holding 2 tokens
    assert bm.allocate(0, tokens) == 0
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert bm.block_tables[0] == bm.block_tables[1] == bm.block_tables[2]
    assert [bm.gpu.blocks[b].ref_count for b in bm.block_tables[0]] == [3, 3, 3]
    bm.check_invariants()
    # seq 1 writes token 10 into the shared last block: it gets a private copy
    copies = bm.append_slots(1, 10, 11)
    assert len(copies) == 1 and copies[0][0] == bm.block_tables[0][2] and copies[0][1] == bm.block_tables[1][2]
    assert bm.gpu.blocks[bm.block_tables[0][2]].ref_count == 2
    assert bm.block_tables[1][:2] == bm.block_tables[0][:2]
    # filling a fresh block needs no copy
    assert bm.append_slots(1, 11, 13) == [] and len(bm.block_tables[1]) == 4
    bm.check_invariants()
    for s in (0, 1, 2):
        bm.free(s)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_copies_are_counted_exactly_when_every_holder_writes_a_shared_block():
    # two sequences share a partial last block and both write it: one copy, the second writer keeps the original.
    # Counting a copy per writer made a swapped group that fits an empty pool wait for a block that never comes.
    bm = BlockManager(num_blocks=4, num_cpu_blocks=4, block_size=4, enable_prefix_caching=False)
    bm.allocate(0, list(range(10)))  # 3 blocks
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert not bm.can_append_slots([(0, 10, 11), (1, 10, 11), (2, 10, 11)])  # 2 copies, 1 free block
    moves = bm.swap_out([0, 1, 2])
    assert len(moves) == 3 and bm.num_free_blocks == 4
    extents = [(10, 11)] * 3
    assert not bm.can_swap_in([0, 1, 2], extents)  # 3 blocks + 2 copies > 4 free
    bm.free(2)
    assert bm.can_swap_in([0, 1], extents[:2])  # 3 blocks + 1 copy = 4
    bm.swap_in([0, 1])
    assert bm.can_append_slots([(0, 10, 11), (1, 10, 11)])
    assert len(bm.append_slots(0, 10, 11)) == 1 and bm.append_slots(1, 10, 11) == []
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_swap_moves_whole_group_and_keeps_internal_sharing():
    bm = BlockManager(num_blocks=8, num_cpu_blocks=8, block_size=4, enable_prefix_caching=False)
    bm.allocate(0, list(range(8)))
    bm.fork(0, 1)
    bm.append_slots(1, 8, 9)
    moves = bm.swap_out([0, 1])
    assert len(moves) == 3 and bm.num_free_blocks == 8 and bm.cpu.num_free == 5
    assert bm.cpu_block_tables[0][:2] == bm.cpu_block_tables[1][:2]  # still shared on the CPU side
    bm.check_invariants()
    assert bm.can_swap_in([0, 1])
    back = bm.swap_in([0, 1])
    assert len(back) == 3 and bm.cpu.num_free == 8
    assert bm.gpu.blocks[bm.block_tables[0][0]].ref_count == 2
    bm.check_invariants()


def test_prefix_cache_hits_confirms_tokens_and_evicts_lru():
    bm = BlockManager(num_blocks=6, num_cpu_blocks=0, block_size=4, enable_prefix_caching=True)
    a = list(range(100, 110))  # 2 full blocks + 2 tokens
    bm.allocate(0, a)
    bm.commit(0, a, len(a))
    b = a[:8] + [7, 7, 7]
    assert bm.allocate(1, b) == 8  # both full blocks shared
    assert bm.block_tables[1][:2] == bm.block_tables[0][:2]
    assert bm.gpu.blocks[bm.block_tables[0][0]].ref_count == 2
    c = a[:4] + [1, 2, 3, 4, 5]  # only the first block matches
    bm.free(1)
    bm.free(0)
    assert bm.num_free_blocks == 6  # cached blocks count as free
    assert bm.allocate(2, c) == 4
    assert bm.prefix_cache_hit_rate > 0
    # the whole prompt in cached blocks: the block with the last token is recomputed
    bm.free(2)
    assert bm.allocate(3, a[:8]) == 4
    bm.free(3)
    bm.reset_prefix_cache()
    assert bm.allocate(4, a) == 0
    bm.check_invariants()


def test_can_allocate_reports_never_for_oversized():
    bm = BlockManager(num_blocks=4, num_cpu_blocks=0, block_size=4)
    assert bm.can_allocate([list(range(17))]) == AllocStatus.NEVER
    assert bm.can_allocate([list(range(16))]) == AllocStatus.OK
    bm.allocate(0, list(range(5)))
    assert bm.can_allocate([list(range(16))]) == AllocStatus.LATER


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "fork", "free", "swap_out", "swap_in", "commit"]),
        st.integers(0, 7),
        st.integers(1, 12),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, prefix=st.booleans(), reuse_first=st.booleans())
def test_accounting_invariants_hold_under_random_operations(ops, prefix, reuse_first):
    bs = 4
    bm = BlockManager(16, 8, bs, enable_prefix_caching=prefix, reuse_first=reuse_first)
    tokens: dict[int, list[int]] = {}  # live sequences
    computed: dict[int, int] = {}
    where: dict[int, str] = {}
    next_id = 0
    for op, pick, n in ops:
        live = sorted(tokens)
        seq = live[pick % len(live)] if live else None
        if op == "alloc":
            toks = [pick % 3] * n + list(range(n))  # a few shared prefixes
            if bm.can_allocate([toks]) == AllocStatus.OK:
                tokens[next_id] = toks
                computed[next_id] = bm.allocate(next_id, toks)
                where[next_id] = "gpu"
                next_id += 1
        elif seq is None:
            continue
        elif op == "append" and where[seq] == "gpu":
            start = len(tokens[seq])
            need = [(seq, start, start + n)]
            if bm.can_append_slots(need):
                bm.append_slots(seq, start, start + n)
                tokens[seq] += [9] * n
        elif op == "fork" and where[seq] == "gpu":
            bm.fork(seq, next_id)
            tokens[next_id], computed[next_id], where[next_id] = list(tokens[seq]), computed[seq], "gpu"
            next_id += 1
        elif op == "free":
            bm.free(seq)
            del tokens[seq], computed[seq], where[seq]
        elif op == "swap_out" and where[seq] == "gpu" and bm.can_swap_out([seq]):
            bm.swap_out([seq])
            where[seq] = "cpu"
        elif op == "swap_in" and where[seq] == "cpu" and bm.can_swap_in([seq]):
            bm.swap_in([seq])
            where[seq] = "gpu"
        elif op == "commit" and where[seq] == "gpu":
            bm.commit(seq, tokens[seq], len(tokens[seq]))
        bm.check_invariants()
        for s, w in where.items():  # every live table covers its tokens
            table = bm.block_tables[s] if w == "gpu" else bm.cpu_block_tables[s]
            assert len(table) == -(-len(tokens[s]) // bs)
    for s in list(tokens):  # finish / abort everything: every block is free again
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == 16 and bm.cpu.num_free == 8
    assert not bm.block_tables and not bm.cpu_block_tables


def test_reuse_first_touches_only_the_blocks_in_use_and_cached_at_once():
    """A lazily committed pool (the CPU engine's): a freed block is taken before one never used, so the blocks
    touched are the most ever held at once (in use, or cached) however many requests come and go; without it the
    free list walks through the whole pool. Cached prefixes are evicted only when no untouched block is left."""
    for prefix in (False, True):
        bm = BlockManager(64, 0, 4, enable_prefix_caching=prefix, reuse_first=True)
        plain = BlockManager(64, 0, 4, enable_prefix_caching=prefix)
        used: dict[BlockManager, set[int]] = {bm: set(), plain: set()}
        for i in range(40):  # one request at a time: 3 blocks each, the first shared by all
            for m in (bm, plain):
                m.allocate(i, [9, 9, 9, 9] + [i] * 7)
                m.commit(i, [9, 9, 9, 9] + [i] * 7, 11)
                m.check_invariants()
                used[m] |= set(m.block_tables[i])
                m.free(i)
        assert bm.num_free_blocks == plain.num_free_blocks == 64
        assert len(used[bm]) == bm.gpu.touched and len(used[plain]) == 64  # without it: the whole pool written
        if prefix:  # shared block, each own full block (cached: untouched blocks remain), one recycled partial
            assert bm.gpu.touched == 1 + 40 + 1 and bm.allocate(99, [9, 9, 9, 9] + [3] * 5) == 8
        else:
            assert bm.gpu.touched == 3
    bm = BlockManager(64, 0, 4, reuse_first=True)
    for i in range(4):  # four at once
        bm.allocate(i, list(range(11)))
    assert bm.gpu.touched == 12 and bm.num_free_blocks == 52
