"""The block pool: fixed-size KV blocks, their reference counts, the free blocks and the hash map.

Owns which physical block holds what. A block is either in use (ref_cnt >= 1, held by one or more
requests' block tables) or free (ref_cnt == 0). A free block may still carry a hash: its KV stays
reusable until the block is handed out again, at which point the hash is dropped from the map (lazy
eviction).

Free blocks are handed out in an order that keeps the set of blocks ever written (on the CPU, the
resident part of a lazily mapped cache) close to what is in use plus what the prefix cache keeps:

1. reusable blocks: written before, holding no cached prefix; the most recently freed first;
2. untouched blocks: never written (or given back to the OS since), lowest id first;
3. cached blocks: free but holding a published prefix, least recently freed first (LRU eviction).

Without (2) before (3) a long-running server would walk the whole pool; without (1) before (2) every
new block would be fresh memory. `max_cached_free_blocks` bounds what (3) may hold while (2) is
used: while more cached blocks are free than that, the oldest of them is evicted before an untouched
block is written, so the blocks ever written stay within the peak in use plus the bound. Eviction
stays lazy (a block keeps its hash until it is needed), so a preempted request's blocks survive
for its resume whenever nothing else needs them; `evict_cached_beyond_cap` applies the bound eagerly,
for the working-set trimmer.

With `record_events()` on, the pool keeps the hashes it published and dropped since the last
`pop_events()` (vLLM's KV events): a data-parallel router in the API process learns from them which
prefixes each replica holds.

Block 0 is reserved as the null block: it is never handed out, so the execution layer can point
padding rows (CUDA graph padding, unused block-table entries) at it. Usable blocks are 1..num_blocks-1.
"""

from __future__ import annotations

import heapq
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
    def __init__(self, num_blocks: int, enable_caching: bool = True, max_cached_free_blocks: int | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if max_cached_free_blocks is not None and max_cached_free_blocks < 0:
            raise ValueError(f"max_cached_free_blocks must be >= 0 (or None), got {max_cached_free_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.max_cached_free_blocks = max_cached_free_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._reusable: list[KVCacheBlock] = []  # a stack: the top was freed last
        self._untouched: list[int] = list(range(1, num_blocks))  # a heap of block ids (sorted is one)
        self.cached_free = FreeBlockQueue(())
        # One block per hash: a second block computed with the same content is simply not cached.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # KV events since the last pop_events(): None while nobody listens (offline, tests).
        self._stored: list[BlockHash] | None = None
        self._removed: list[BlockHash] | None = None
        self._cleared = False

    def record_events(self) -> None:
        """From now on, keep the hashes published and dropped until `pop_events()` takes them."""
        self._stored, self._removed = [], []

    def pop_events(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """(hashes published, hashes dropped, whether the whole cache was reset first) since the last call."""
        if self._stored is None:
            return [], [], False
        out = (self._stored, self._removed, self._cleared)
        self._stored, self._removed, self._cleared = [], [], False
        return out

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return len(self._reusable) + len(self._untouched) + self.cached_free.num_free_blocks

    @property
    def num_touched_blocks(self) -> int:
        """Blocks written since start or since their memory was last given back."""
        return self.num_usable_blocks - len(self._untouched)

    def get_usage(self) -> float:
        return (self.num_usable_blocks - self.get_num_free_blocks()) / self.num_usable_blocks

    def free_block_ids(self) -> list[int]:
        """Every free block, in the order they would be handed out. O(n): for tests and debugging."""
        return (
            [b.block_id for b in reversed(self._reusable)]
            + sorted(self._untouched)
            + [b.block_id for b in self.cached_free.get_all_free_blocks()]
        )

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
            if self._stored is not None:
                self._stored.append(h)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n free blocks (reusable, then untouched, then cached: see the module docstring)."""
        if n > self.get_num_free_blocks():
            raise ValueError(f"asked for {n} blocks, {self.get_num_free_blocks()} free")
        reusable = self._reusable
        k = min(n, len(reusable))
        out = reusable[len(reusable) - k:]
        out.reverse()
        del reusable[len(reusable) - k:]
        cap = self.max_cached_free_blocks
        if len(out) < n and cap is not None and self.cached_free.num_free_blocks > cap:
            over = self.cached_free.popleft_n(min(n - len(out), self.cached_free.num_free_blocks - cap))
            for block in over:
                self._drop_hash(block)
            out.extend(over)
        if len(out) < n:
            untouched, blocks = self._untouched, self.blocks
            for _ in range(min(n - len(out), len(untouched))):
                out.append(blocks[heapq.heappop(untouched)])
        if len(out) < n:
            evicted = self.cached_free.popleft_n(n - len(out))
            for block in evicted:
                self._drop_hash(block)
            out.extend(evicted)
        for block in out:
            block.ref_cnt = 1
        return out

    def _drop_hash(self, block: KVCacheBlock) -> None:
        del self.cached_block_hash_to_block[block.block_hash]
        if self._removed is not None:
            self._removed.append(block.block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the cached queue."""
        queue = self.cached_free
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching 0 become free in this order (see the docstring)."""
        queue, reusable = self.cached_free, self._reusable
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    reusable.append(block)
                else:
                    queue.append(block)

    def evict_cached_beyond_cap(self) -> int:
        """Evict the least recently used cached free blocks beyond `max_cached_free_blocks` (they
        become reusable, holding nothing). Returns how many."""
        cap, queue = self.max_cached_free_blocks, self.cached_free
        if cap is None or queue.num_free_blocks <= cap:
            return 0
        evicted = queue.popleft_n(queue.num_free_blocks - cap)
        for block in evicted:
            self._drop_hash(block)
        self._reusable[:0] = evicted  # under the stack: the first to be released
        return len(evicted)

    def release_reusable(self, n: int) -> list[int]:
        """Move up to n reusable blocks, the longest free first, to the untouched ones, and return
        their ids: the caller gives their memory back to the OS, so they count as fresh again."""
        reusable = self._reusable
        k = min(n, len(reusable))
        released = [b.block_id for b in reusable[:k]]
        del reusable[:k]
        for block_id in released:
            heapq.heappush(self._untouched, block_id)
        return released

    @property
    def num_reusable_blocks(self) -> int:
        return len(self._reusable)

    def drop_all_hashes(self) -> None:
        """Forget every hash, in use or not: cached free blocks become reusable, blocks in use stay
        with their requests unpublished (freed, they become reusable)."""
        for block in self.cached_free.popleft_n(self.cached_free.num_free_blocks):
            block.block_hash = None
            self._reusable.append(block)
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use: its request may still publish."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.cached_free.popleft_n(self.cached_free.num_free_blocks):
            block.block_hash = None
            self._reusable.append(block)
        self.cached_block_hash_to_block.clear()
        if self._stored is not None:
            self._stored, self._removed, self._cleared = [], [], True
        return True
