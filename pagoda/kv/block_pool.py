"""The block pool: fixed-size KV blocks, their reference counts, the LRU free queue and the hash map.

Owns which physical block holds what. A block is either in use (ref_cnt >= 1, held by one or more
requests' block tables) or free (ref_cnt == 0, in the free queue). A free block may still carry a
hash: its KV stays reusable until the block is handed out again, at which point the hash is dropped
from the map (lazy eviction). The queue is ordered by eviction priority, front first.

Block 0 is reserved as the null block: it is never handed out, so the execution layer can point
padding rows (CUDA graph padding, unused block-table entries) at it. Usable blocks are 1..num_blocks-1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagoda.kv.hashing import BlockHash

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One physical block. prev_free/next_free link it into the free queue while it is free."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks with sentinels: O(1) popleft, append and remove-from-middle.

    A deque cannot remove from the middle in O(1), and a cache hit on a free block must take that
    block out wherever it is.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        block = self._head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front (evicted first) to back. O(n): for tests and debugging."""
        out = []
        block = self._head.next_free
        while block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        # One block per hash: a second block computed with the same content is simply not cached.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return (self.num_usable_blocks - self.free_block_queue.num_free_blocks) / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash], start: int, end: int
    ) -> None:
        """Publish blocks[start:end] (full, KV written) under block_hashes[start:end]."""
        if not self.enable_caching:
            return
        table = self.cached_block_hash_to_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix-cache hit: already published
            h = block_hashes[i]
            if h in table:
                continue  # same content already cached in another block; keep one copy
            block.block_hash = h
            table[h] = block

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the front of the free queue, evicting any hash they still carry."""
        blocks = self.free_block_queue.popleft_n(n)
        table = self.cached_block_hash_to_block
        for block in blocks:
            if block.block_hash is not None:
                del table[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching 0 join the back of the queue in this order."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use: its request may still publish."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
