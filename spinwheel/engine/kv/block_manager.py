"""KV-cache accounting for PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023). Pure Python: it keeps books, it never touches a tensor.

The cache is a pool of fixed-size blocks. Each sequence owns a *block table* (logical block i -> physical block id)
and every physical block carries a reference count equal to the number of block tables that hold it:

* ``fork`` shares all of a parent's blocks with a child (ref += 1);
* ``append_slots`` grows a table to hold new tokens and copies a shared block before it is written
  (copy-on-write), returning the (src, dst) copies the model runner must perform;
* ``free`` drops a table (ref -= 1); blocks at zero return to the pool;
* ``swap_out`` / ``swap_in`` move a whole group's tables between the device pool and a CPU pool, all or nothing,
  returning the (src, dst) block moves.

Prefix caching: a full block is keyed by a hash chained from the previous block's key and its own tokens; lookups
confirm the stored tokens, so a hash collision can never hand out wrong K/V. A cached block whose reference count
drops to zero stays in an LRU list, still counted as free, until an allocation evicts it. A sequence's chain starts
from its *namespace* (the LoRA adapter it runs through; None: the base): the same tokens computed through another
adapter hold other K/V, so they are never shared across namespaces.
"""

from __future__ import annotations

import enum

from spinwheel.engine.kv.block_pool import Block, BlockPool, OutOfBlocks, chain_hash  # noqa: F401 (re-exported)


class AllocStatus(enum.Enum):
    OK = "ok"  # fits now
    LATER = "later"  # fits once other sequences free blocks
    NEVER = "never"  # larger than the whole pool


class BlockManager:
    """Block tables of all sequences over a device pool and a CPU swap pool.

    Sequences are named by integer ids; token lists are passed in where content matters (prefix caching).
    """

    def __init__(
        self,
        num_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        reuse_first: bool = False,
    ) -> None:
        self.block_size = block_size
        self.gpu = BlockPool(num_blocks, reuse_first)  # reuse_first: see BlockPool (a lazily committed KV pool)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[int, list[int]] = {}  # seq_id -> device block ids
        self.cpu_block_tables: dict[int, list[int]] = {}  # seq_id -> CPU block ids (swapped out)
        self._hashes: dict[int, list[int]] = {}  # seq_id -> chained keys of its leading full blocks
        self._roots: dict[int, int | None] = {}  # seq_id -> the key its chain starts from (its namespace's)
        self.num_prefix_queried_tokens = 0
        self._resets = 0  # prefix-cache resets (weight changes) so far
        self.num_prefix_hit_tokens = 0

    # ---- sizes ----
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.gpu.num_blocks - self.gpu.num_free

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(1, self.num_prefix_queried_tokens)

    # ---- allocation of new (or recomputed) sequences ----
    def _match_prefix(self, token_ids: list[int], use_cache: bool = True, namespace: str | None = None) -> list[int]:
        """Cached device blocks holding the leading full blocks of ``token_ids`` (computed in ``namespace``). The
        block holding the last token is never matched: its logits must be computed. ``use_cache=False``: none (a
        request that wants the logits of every prompt token computes them all; its blocks are still registered for
        others)."""
        if not self.enable_prefix_caching or not use_cache:
            return []
        bs, matched, key = self.block_size, [], namespace_root(namespace)
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = chain_hash(key, tokens)
            block_id = self.gpu.lookup(key, tokens)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def can_allocate(
        self, seqs: list[list[int]], num_shared_tokens: int = 0, use_cache: bool = True, namespace: str | None = None
    ) -> AllocStatus:
        """Whether sequences with these token lists (one group, in ``namespace``) can get block tables now. With
        ``num_shared_tokens`` (a multiple of the block size) every sequence after the first shares the first one's
        blocks holding those leading tokens (a recomputed group forked again, see :meth:`fork`)."""
        shared = num_shared_tokens // self.block_size
        total = sum(self.num_blocks_for(len(t)) - (shared if i else 0) for i, t in enumerate(seqs))
        if total > self.gpu.num_blocks:
            return AllocStatus.NEVER
        needed = total
        for tokens in seqs[:1] if shared else seqs:
            # A matched block that nobody holds sits on the free side; reviving it consumes a free block.
            matched = self._match_prefix(tokens, use_cache, namespace)
            needed -= sum(1 for b in matched if self.gpu.blocks[b].ref_count > 0)
        return AllocStatus.OK if needed <= self.gpu.num_free else AllocStatus.LATER

    def allocate(self, seq_id: int, token_ids: list[int], use_cache: bool = True, namespace: str | None = None) -> int:
        """Give ``seq_id`` (computed in ``namespace``) a block table for all of ``token_ids``; returns how many
        leading tokens already have K/V through the prefix cache."""
        assert seq_id not in self.block_tables, f"sequence {seq_id} already has blocks"
        matched = self._match_prefix(token_ids, use_cache, namespace)
        needed = self.num_blocks_for(len(token_ids))
        fresh = needed - len(matched)
        revived = sum(1 for b in matched if self.gpu.blocks[b].ref_count == 0)
        if fresh + revived > self.gpu.num_free:
            raise OutOfBlocks(f"sequence {seq_id} needs {fresh + revived} blocks, {self.gpu.num_free} are free")
        for b in matched:
            self.gpu.incref(b)
        table = matched + [self.gpu.allocate() for _ in range(fresh)]
        self.block_tables[seq_id] = table
        self._hashes[seq_id] = [self.gpu.blocks[b].hash for b in matched]  # type: ignore[misc]
        self._roots[seq_id] = namespace_root(namespace)
        if self.enable_prefix_caching and use_cache:
            self.num_prefix_queried_tokens += len(token_ids)
            self.num_prefix_hit_tokens += len(matched) * self.block_size
        return len(matched) * self.block_size

    def commit(self, seq_id: int, token_ids: list[int], num_tokens: int) -> None:
        """Record that the first ``num_tokens`` tokens of ``seq_id`` have (or, within this step, will have) K/V:
        their full blocks become reusable through the prefix cache."""
        if not self.enable_prefix_caching or seq_id not in self.block_tables:
            return
        hashes, table, bs = self._hashes[seq_id], self.block_tables[seq_id], self.block_size
        for i in range(len(hashes), min(num_tokens // bs, len(table))):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = chain_hash(hashes[-1] if hashes else self._roots.get(seq_id), tokens)
            self.gpu.register(table[i], key, tokens)
            hashes.append(key)

    # ---- growth, copy-on-write, fork ----
    def _blocks_to_append(self, tables: dict[int, list[int]], pool: BlockPool, seqs: list[tuple[int, int, int]]) -> int:
        """Blocks that extending ``seqs`` (seq_id, num_computed_tokens, num_tokens) takes from ``pool``: new blocks
        past their tables, and the copies :meth:`append_slots` makes of blocks it writes while they are shared —
        a block held by ``r`` tables and written by ``w`` of them is copied ``w`` times, or ``r - 1`` when all its
        holders write it (the last one then holds it alone)."""
        need, writers, blocks, bs = 0, {}, pool.blocks, self.block_size
        for seq_id, num_computed, num_tokens in seqs:
            table = tables[seq_id]
            end = -(-num_tokens // bs)
            need += max(0, end - len(table))
            for i in range(num_computed // bs, min(len(table), end)):
                if blocks[table[i]].ref_count > 1:  # private blocks are written in place
                    writers[table[i]] = writers.get(table[i], 0) + 1
        return need + sum(min(w, blocks[b].ref_count - 1) for b, w in writers.items())

    def can_append_slots(self, seqs: list[tuple[int, int, int]]) -> bool:
        """``seqs``: (seq_id, num_computed_tokens, num_tokens) of every sequence about to be extended."""
        return self._blocks_to_append(self.block_tables, self.gpu, seqs) <= self.gpu.num_free

    def append_slots(self, seq_id: int, num_computed: int, num_tokens: int) -> list[tuple[int, int]]:
        """Make room for tokens ``num_computed .. num_tokens-1``; returns copy-on-write (src, dst) block copies."""
        table = self.block_tables[seq_id]
        copies = []
        last = min(len(table), self.num_blocks_for(num_tokens))
        for i in range(num_computed // self.block_size, last):
            src = table[i]
            if self.gpu.blocks[src].ref_count > 1:  # shared: write into a private copy
                dst = self.gpu.allocate()
                self.gpu.decref(src)
                table[i] = dst
                copies.append((src, dst))
                del self._hashes[seq_id][i:]
        while len(table) < self.num_blocks_for(num_tokens):
            table.append(self.gpu.allocate())
        return copies

    def fork(self, parent_id: int, child_id: int, num_tokens: int | None = None) -> None:
        """``child_id`` shares every block of ``parent_id`` — or only those holding its first ``num_tokens`` tokens
        (then grow the child with :meth:`append_slots`)."""
        table = self.block_tables[parent_id]
        if num_tokens is not None:
            table = table[: self.num_blocks_for(num_tokens)]
        for b in table:
            self.gpu.incref(b)
        self.block_tables[child_id] = list(table)
        self._hashes[child_id] = self._hashes[parent_id][: len(table)]
        self._roots[child_id] = self._roots.get(parent_id)

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``'s table (device or CPU); blocks nobody else holds return to their pool. Tail blocks are
        released first so the LRU evicts a prefix's end before its start."""
        for table, pool in (
            (self.block_tables.pop(seq_id, None), self.gpu),
            (self.cpu_block_tables.pop(seq_id, None), self.cpu),
        ):
            for b in reversed(table or []):
                pool.decref(b)
        self._hashes.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    # ---- swapping (whole groups) ----
    def _distinct(self, tables: dict[int, list[int]], seq_ids: list[int]) -> set[int]:
        return {b for s in seq_ids for b in tables[s]}

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return len(self._distinct(self.block_tables, seq_ids)) <= self.cpu.num_free

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the group's device blocks to the CPU pool; returns (device, cpu) copies. Blocks shared inside the
        group stay shared; blocks shared with other groups (prefix cache) get a private CPU copy."""
        return self._move(seq_ids, self.block_tables, self.cpu_block_tables, self.gpu, self.cpu)

    def can_swap_in(self, seq_ids: list[int], extents: list[tuple[int, int]] | None = None) -> bool:
        """Whether the group's blocks fit back on the device — and, given each sequence's (num_computed_tokens,
        num_tokens), the blocks its next tokens add (new blocks; copies of blocks shared inside the group)."""
        need = len(self._distinct(self.cpu_block_tables, seq_ids))
        if extents:
            need += self._blocks_to_append(
                self.cpu_block_tables, self.cpu, [(s, c, t) for s, (c, t) in zip(seq_ids, extents)]
            )
        return need <= self.gpu.num_free

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        return self._move(seq_ids, self.cpu_block_tables, self.block_tables, self.cpu, self.gpu)

    def _move(
        self,
        seq_ids: list[int],
        src_tables: dict[int, list[int]],
        dst_tables: dict[int, list[int]],
        src: BlockPool,
        dst: BlockPool,
    ) -> list[tuple[int, int]]:
        distinct = self._distinct(src_tables, seq_ids)
        if len(distinct) > dst.num_free:
            raise OutOfBlocks(f"moving {len(distinct)} blocks, {dst.num_free} free at the destination")
        mapping: dict[int, int] = {}
        for s in seq_ids:
            new_table = []
            for b in src_tables.pop(s):
                if b in mapping:
                    dst.incref(mapping[b])
                else:
                    mapping[b] = dst.allocate()
                new_table.append(mapping[b])
                src.decref(b)
            dst_tables[s] = new_table
        return list(mapping.items())

    # ---- prefix cache ----
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (call when the weights change)."""
        self.gpu.reset_cache()
        self._resets += 1
        for s in self._hashes:  # a live sequence's blocks hold old K/V: its chain restarts from a key nobody matches
            self._hashes[s], self._roots[s] = [], hash(("stale", self._resets, s))

    # ---- inspection ----
    def sharing(self) -> tuple[int, int]:
        """(blocks held by all tables counted per table, distinct device blocks in use)."""
        logical = sum(len(t) for t in self.block_tables.values())
        return logical, self.num_used_blocks

    def check_invariants(self) -> None:
        """Assert exact accounting on both pools (used by the property tests)."""
        for tables, pool in ((self.block_tables, self.gpu), (self.cpu_block_tables, self.cpu)):
            refs: dict[int, int] = {}
            for table in tables.values():
                for b in table:
                    refs[b] = refs.get(b, 0) + 1
            pool.check(refs)


def namespace_root(namespace: str | None) -> int | None:
    """The key a prefix chain in ``namespace`` starts from (None for the base model's)."""
    return None if namespace is None else hash(("lora", namespace))
