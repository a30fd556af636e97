"""The physical KV-block pool behind :class:`~spinwheel.engine.kv.block_manager.BlockManager`: free list, reference
counts and the prefix cache (full blocks keyed by a hash chained from the previous block's key, with their tokens
stored so a collision can never hand out wrong K/V; cached blocks at zero references wait in an LRU list, counted as
free, until an allocation evicts them). Pure Python."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


class OutOfBlocks(RuntimeError):
    """An allocation was attempted without checking ``can_*`` first."""


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    """Key of a full block: the previous block's key and this block's tokens."""
    return hash((prev, tokens))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept for cached blocks, to confirm a hash hit


class BlockPool:
    """Blocks of one device, with free list, reference counts and (optionally) a prefix-cache index."""

    def __init__(self, num_blocks: int, reuse_first: bool = False) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(() if reuse_first else range(num_blocks))  # ref 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 with a hash, least recently used first
        self._by_hash: dict[int, int] = {}
        # reuse_first (a pool whose memory is committed as its blocks are first written: the CPU engine's): a freed
        # block is taken again before one never used (last freed, first taken), and one never used before a cached
        # prefix is evicted (as without it); so the memory touched is what the blocks in use and the prefix cache
        # ever held at once, not the whole pool once the free list has cycled through it. The blocks never used are
        # ids [touched, num_blocks), outside _free.
        self.reuse_first = reuse_first
        self.touched = 0 if reuse_first else num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable) + self._untouched

    @property
    def _untouched(self) -> int:
        return self.num_blocks - self.touched if self.reuse_first else 0

    def allocate(self) -> int:
        if self._free:
            block_id = self._free.pop() if self.reuse_first else self._free.popleft()
        elif self._untouched:
            block_id = self.touched
            self.touched += 1
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._unhash(self.blocks[block_id])
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        self.blocks[block_id].ref_count = 1
        return block_id

    def incref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id)  # only hashed blocks are revived from the free side
        block.ref_count += 1

    def decref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def lookup(self, key: int, tokens: tuple[int, ...]) -> int | None:
        block_id = self._by_hash.get(key)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def register(self, block_id: int, key: int, tokens: tuple[int, ...]) -> None:
        block = self.blocks[block_id]
        if block.hash is not None or key in self._by_hash:
            return  # already cached, or the same content lives in another block
        block.hash, block.token_ids = key, tokens
        self._by_hash[key] = block_id

    def _unhash(self, block: Block) -> None:
        if block.hash is not None and self._by_hash.get(block.hash) == block.block_id:
            del self._by_hash[block.hash]
        block.hash, block.token_ids = None, ()

    def reset_cache(self) -> None:
        """Forget every cached prefix (the weights changed): evictable blocks become plain free blocks."""
        for block in self.blocks:
            self._unhash(block)
        self._free.extend(self._evictable)
        self._evictable.clear()

    def check(self, refs: dict[int, int]) -> None:
        """Assert the accounting invariants given the reference counts implied by the block tables."""
        untouched = set(range(self.touched, self.touched + self._untouched))
        free = set(self._free) | set(self._evictable) | untouched
        assert len(free) == len(self._free) + len(self._evictable) + len(untouched), "a block is free twice"
        used = [b.block_id for b in self.blocks if b.ref_count > 0]
        assert len(free) + len(used) == self.num_blocks, "free + used != total"
        for block in self.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs.get(block.block_id, 0)} tables"
            )
            assert (block.ref_count == 0) == (block.block_id in free)
            if block.block_id in self._evictable:
                assert block.hash is not None
        for key, block_id in self._by_hash.items():
            assert self.blocks[block_id].hash == key
