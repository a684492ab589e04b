"""The KV cache manager: each request's block table, prefix-cache lookups and slot allocation.

Owns the mapping request -> blocks on top of the BlockPool. It decides nothing about who runs: the
scheduler asks it for cached prefixes and for room for N more tokens, and tells it when tokens have
been computed (so their full blocks can be published) and when a request is done.

Publishing rule: a full block enters the hash map only once its KV has been written, i.e. after the
step that computed it (`cache_blocks`, called by the scheduler's update, or at `free`). So two
requests admitted in the same step never hit each other's still-uncomputed blocks. A block loaded
from the second tier is published at once: the load runs before the step's forward.

With a second tier (`offload`, see pagoda.kv.tier_manager) a lookup continues there where the first
tier's prefix ends, freed published blocks are copied down, and `swap_out` keeps a preempted
request's blocks for its resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagoda.contracts.step import SchedulerOutput
from pagoda.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.kv.hashing import BlockHash, BlockHasher, hash_block_tokens
from pagoda.kv.offload import OffloadStats, SecondTier
from pagoda.kv.tier_manager import TierManager


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
        offload: SecondTier | None = None,
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
        self.tier = TierManager(offload, self.block_pool, block_size) if offload is not None else None
        # request id -> blocks of its last admission from each tier (first, second), for timelines.
        self.admission_sources: dict[str, tuple[int, int]] = {}

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
        tier = self.tier
        if tier is not None:
            tier.lookup = None
            swapped = tier.find_swapped(request.request_id, request.num_tokens)
            if swapped is not None:
                return swapped
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
        num_hit = len(hits) * self.block_size
        if tier is not None and len(hits) < max_blocks:
            n = tier.find_prefix(request.request_id, request.block_hashes[len(hits):max_blocks],
                                 request.num_tokens - num_hit)
            return hits, num_hit + n * self.block_size
        return hits, num_hit

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
        lookup = self.tier.take_lookup(rid) if self.tier is not None and blocks is None else None
        num_loaded = lookup.num_tokens if lookup is not None else 0
        num_tokens = request.num_computed_tokens + len(hits) * bs + num_loaded + num_new_tokens
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
            # Blocks pinned by background copies become free once their copies run before the forward.
            if self.tier is None or not self.tier.expedite_saves():
                return None
            num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)  # hits whose copy pinned them
            if max(num_new_blocks, 0) + num_free_hits > pool.get_num_free_blocks():
                return None

        if blocks is None:
            blocks = self._new_table(rid)
            if self.enable_prefix_caching:
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += len(hits) * bs
            self.admission_sources[rid] = (len(hits), len(lookup.entries) if lookup is not None else 0)
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
        if lookup is not None:
            loaded = new_blocks[: len(lookup.entries)]  # none when a swap-in found all in the first tier
            if loaded or lookup.swap:
                self.num_cached_blocks[rid] = len(hits) + self.tier.order_loads(lookup, loaded)
            if not lookup.swap:  # the second tier's queries and hits, as the first tier's: at admission
                self.tier.stats.queries += lookup.query_tokens
                self.tier.stats.hits += num_loaded
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

    def free(self, request: KVRequest, preempted: bool = False) -> None:
        """Release the request's blocks, tail first, so shared prefixes are evicted after tails.

        Blocks full of computed tokens are published first, so a preempted or finished request's
        KV stays reusable until evicted. With a second tier they are copied down too; a preempted
        request's (`preempted`) before the next forward, which may reuse them.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            if self.tier is not None:
                self.tier.forget_swapped(rid)  # it ended while swapped out
            return
        self.cache_blocks(request)
        self.unpublishable.discard(rid)
        del self.req_to_blocks[rid]
        del self.req_to_block_ids[rid]
        del self.num_cached_blocks[rid]
        self.admission_sources.pop(rid, None)
        if self.tier is not None and self.enable_prefix_caching:
            self.tier.save_published(blocks, first=preempted)
        self.block_pool.free_blocks(reversed(blocks))

    # -- the second tier -------------------------------------------------------------------------
    def swap_out(self, request: KVRequest) -> bool:
        """Order the request's computed blocks into the second tier for its resume (before `free`).
        False (nothing changed) without a second tier or when it has no room: then recompute."""
        rid, bs, tier = request.request_id, self.block_size, self.tier
        blocks = self.req_to_blocks.get(rid)
        nc = request.num_computed_tokens
        if tier is None or not blocks or nc == 0:
            return False
        self.cache_blocks(request)
        n = -(-nc // bs)
        published = [self.enable_prefix_caching and (i + 1) * bs <= nc for i in range(n)]
        hashes = request.block_hashes
        # A private key for a block no other request can share (a partial one, or no prefix caching).
        keys = [hashes[i] if published[i] else hash(("swap", rid, i)) for i in range(n)]
        return tier.swap_out(rid, nc, blocks[:n], keys, published)

    @property
    def offload_stats(self) -> OffloadStats | None:
        return self.tier.stats if self.tier is not None else None

    def has_pending_transfers(self) -> bool:
        return self.tier is not None and self.tier.has_pending

    def take_transfers(self, out: SchedulerOutput) -> None:
        """Put the copies ordered since the last step into `out` (the step being built)."""
        if self.tier is not None:
            self.tier.take(out)

    def transfers_done(self, failed_save_slots: list[int] = ()) -> None:
        """The last built step has run: its copies are complete, but for saves into these slots."""
        if self.tier is not None:
            self.tier.done(failed_save_slots)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (the second tier's unpinned entries too); refused (False) while any
        block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._drop_second_tier()
        return True

    def _drop_second_tier(self) -> None:
        if self.tier is not None:
            tier = self.tier.tier
            for entry in list(tier.lru.values()):
                tier.drop(entry)

    def flush_prefix_cache(self) -> None:
        """Forget every hash, of blocks in use too (and the second tier's unpinned entries), and never
        publish the blocks of the requests holding blocks now: the weights changed under them, so no
        later request may hit their KV."""
        self.block_pool.drop_all_hashes()
        self._drop_second_tier()
        self.unpublishable.update(self.req_to_blocks)
