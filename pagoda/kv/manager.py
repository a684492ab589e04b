"""The KV cache manager: each request's block table, prefix-cache lookups and slot allocation.

Owns the mapping request -> blocks on top of the BlockPool. It decides nothing about who runs: the
scheduler asks it for cached prefixes and for room for N more tokens, and tells it when tokens have
been computed (so their full blocks can be published) and when a request is done.

Publishing rule: a full block enters the hash map only once its KV has been written, i.e. after the
step that computed it (`cache_blocks`, called by the scheduler's update, or at `free`). So two
requests admitted in the same step never hit each other's still-uncomputed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagoda.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.kv.hashing import BlockHash, BlockHasher, hash_block_tokens


class KVRequest(Protocol):
    """What the manager needs from a request (pagoda.sched.request.Request has it)."""

    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]

    @property
    def num_tokens(self) -> int: ...

    def bind_block_hashing(self, block_size: int, hasher: BlockHasher = ...) -> None: ...


@dataclass
class PrefixCacheStats:
    """Counted in tokens, once per admission (first allocation of a request's table)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hasher: BlockHasher = hash_block_tokens,
        max_cached_free_blocks: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, max_cached_free_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Kept beside req_to_blocks so the scheduler can hand the table out without rebuilding it.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each table are published (hashed) or were hits.
        self.num_cached_blocks: dict[str, int] = {}
        # Requests whose blocks must never be published: their KV was computed by weights since
        # replaced (flush_prefix_cache); the set empties as they free their blocks.
        self.unpublishable: set[str] = set()
        self.prefix_cache_stats = PrefixCacheStats()

    # -- reporting ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table in order (the live list: read it, do not mutate it)."""
        return self.req_to_block_ids.get(request_id, [])

    def bind(self, request: KVRequest) -> None:
        """Make the request hash its full blocks with this manager's block size and hasher."""
        request.bind_block_hashing(self.block_size, self.hasher)

    # -- lookup and allocation -----------------------------------------------------------------
    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as (blocks, num_tokens).

        Stops one token short of the request's end: the last token must be computed to get the
        logits that sample the next one, so a fully cached prompt still recomputes its last block
        (or its last token, when the length is not a multiple of the block size).
        """
        if not self.enable_prefix_caching:
            return [], 0
        self.bind(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        table = self.block_pool.cached_block_hash_to_block
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = table.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make room for num_new_tokens after the request's computed tokens (and new cache hits).

        All or nothing: on failure (None) no ref count, queue or table changes. On success returns
        the ids of the newly allocated blocks (possibly empty), appended to the request's table
        after the hit blocks.
        """
        rid = request.request_id
        bs = self.block_size
        blocks = self.req_to_blocks.get(rid)
        num_held = len(blocks) if blocks is not None else 0
        hits = new_computed_blocks or ()
        num_tokens = request.num_computed_tokens + len(hits) * bs + num_new_tokens
        num_new_blocks = -(-num_tokens // bs) - num_held - len(hits)

        if num_new_blocks <= 0 and not hits:
            # Decode fast path: the next slot is inside a block the request already holds.
            if blocks is None:
                self._new_table(rid)
            return []

        if hits and num_held:
            raise ValueError(f"cache hits for {rid!r}, which already holds blocks: hits come at admission")
        pool = self.block_pool
        # Hit blocks that sit in the free queue are consumed from it too.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_free_hits > pool.get_num_free_blocks():
            return None

        if blocks is None:
            blocks = self._new_table(rid)
            if self.enable_prefix_caching:
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += len(hits) * bs
        block_ids = self.req_to_block_ids[rid]
        if hits:
            # Touch hits before taking new blocks, so allocation evicts other free blocks first.
            pool.touch(hits)
            blocks.extend(hits)
            block_ids.extend(b.block_id for b in hits)
            self.num_cached_blocks[rid] = len(blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        new_ids = [b.block_id for b in new_blocks]
        block_ids.extend(new_ids)
        return new_ids

    def _new_table(self, rid: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        self.req_to_blocks[rid] = blocks
        self.req_to_block_ids[rid] = []
        self.num_cached_blocks[rid] = 0
        return blocks

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int | None = None) -> None:
        """Publish the request's blocks made full by its computed tokens (their KV is written)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_full = num_computed_tokens // self.block_size
        num_cached = self.num_cached_blocks.get(rid)
        if num_cached is None or num_full <= num_cached or rid in self.unpublishable:
            return
        self.bind(request)
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[rid], request.block_hashes, num_cached, num_full
        )
        self.num_cached_blocks[rid] = num_full

    def free_tail(self, request: KVRequest, num_tokens: int) -> int:
        """Give back the blocks past the first `num_tokens` tokens' (slots allocated for draft
        tokens that were rejected). Those blocks hold no verified token, so none is published or
        shared. Returns how many were freed."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            return 0
        keep = -(-num_tokens // self.block_size)
        if len(blocks) <= keep:
            return 0
        if keep < self.num_cached_blocks[rid]:
            raise ValueError(f"{rid}: cannot free published blocks (keeping {keep} of {self.num_cached_blocks[rid]})")
        tail = blocks[keep:]
        del blocks[keep:]
        del self.req_to_block_ids[rid][keep:]
        self.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def free(self, request: KVRequest) -> None:
        """Release the request's blocks, tail first, so shared prefixes are evicted after tails.

        Blocks full of computed tokens are published first, so a preempted or finished request's
        KV stays reusable until evicted.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            return
        self.cache_blocks(request)
        self.unpublishable.discard(rid)
        del self.req_to_blocks[rid]
        del self.req_to_block_ids[rid]
        del self.num_cached_blocks[rid]
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def flush_prefix_cache(self) -> None:
        """Forget every hash, of blocks in use too, and never publish the blocks of the requests
        holding blocks now: the weights changed under them, so no later request may hit their KV."""
        self.block_pool.drop_all_hashes()
        self.unpublishable.update(self.req_to_blocks)
