"""What the KV manager does with a second tier: copy published blocks down when requests free them,
find prefixes the first tier lost, swap preempted requests out and back in, and hand the copies to
the step as plain orders (`contracts.step.KVTransfer`).

Saves happen when a request frees its blocks (finished or preempted): every published block the
second tier lacks is copied down, so a later eviction from the first tier loses nothing. A finished
request's blocks are pinned (one extra reference) from the order until the step that carries it has
run, so they are neither handed out nor overwritten while the copy reads them, and the runner copies
beside the forward pass. A preempted request's blocks are freed to make room in the very step being
built, so their copies run first, before that step's loads and forward (`kv_saves_first`), unpinned.
Loads go into freshly allocated blocks before the forward that reads them, and pin their entries
until that step has run. Orders made between steps wait in `pending` for the next step.

Swap preemption saves every block that holds a computed token of the victim, its partial last block
and (without prefix caching) unhashed blocks included, under private keys; those entries stay
pinned until the request resumes (then they are loaded and dropped) or ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.contracts.step import KVTransfer, SchedulerOutput
from pagoda.kv.block_pool import BlockPool, KVCacheBlock
from pagoda.kv.hashing import BlockHash
from pagoda.kv.offload import OffloadStats, SecondTier, TierEntry


@dataclass
class TierLookup:
    """Second-tier hits of one request's admission, found by `get_computed_blocks`."""

    request_id: str
    entries: list[TierEntry]
    num_tokens: int  # tokens they hold (the last block may be partial on a swap-in)
    published: list[bool]  # whether each key is a block hash (published in the first tier on load)
    swap: bool = False
    query_tokens: int = 0  # prompt tokens the first tier missed (the second tier's query), for stats


@dataclass
class SwapState:
    num_computed_tokens: int
    entries: list[TierEntry]
    published: list[bool]


@dataclass
class _StepOrders:
    saves: list[tuple[KVTransfer, TierEntry, KVCacheBlock]] = field(default_factory=list)
    saves_first: list[tuple[KVTransfer, TierEntry]] = field(default_factory=list)
    loads: list[tuple[KVTransfer, TierEntry]] = field(default_factory=list)
    drops: list[TierEntry] = field(default_factory=list)  # private swap entries, once loaded


class TierManager:
    def __init__(self, tier: SecondTier, pool: BlockPool, block_size: int) -> None:
        self.tier = tier
        self.pool = pool
        self.block_size = block_size
        self.stats = OffloadStats()
        self.pending = _StepOrders()  # ordered since the last step was built
        self.in_step = _StepOrders()  # handed to the step being run
        self.swapped: dict[str, SwapState] = {}
        self.lookup: TierLookup | None = None

    # -- pins --------------------------------------------------------------------------------
    def pinned_blocks(self) -> dict[int, int]:
        """block id -> extra references held by copies in flight (for the invariant checks)."""
        out: dict[int, int] = {}
        for orders in (self.pending, self.in_step):
            for _, _, block in orders.saves:
                out[block.block_id] = out.get(block.block_id, 0) + 1
        return out

    @property
    def has_pending(self) -> bool:
        p = self.pending
        return bool(p.saves or p.saves_first or p.loads or p.drops)

    def _order_save(self, block: KVCacheBlock, entry: TierEntry, first: bool) -> None:
        transfer = KVTransfer(block.block_id, entry.slot, entry.key)
        if first:
            self.pending.saves_first.append((transfer, entry))
            return
        block.ref_cnt += 1  # the copy's reference: the block is not handed out until it is done
        self.pending.saves.append((transfer, entry, block))

    def expedite_saves(self) -> bool:
        """Turn the pending background saves into saves before the next forward, so their blocks
        are free at once (the step being built needs room). False when there were none."""
        pending = self.pending
        if not pending.saves:
            return False
        for transfer, entry, block in pending.saves:
            pending.saves_first.append((transfer, entry))
            self.pool.free_blocks((block,))
        pending.saves = []
        return True

    # -- saves when blocks are freed -------------------------------------------------------------
    def save_published(self, blocks: list[KVCacheBlock], first: bool = False) -> None:
        """Copy down the published blocks the second tier does not hold yet (`first`: before the
        next forward, for blocks that step may reuse)."""
        tier = self.tier
        for block in blocks:
            key = block.block_hash
            if key is None or key in tier:
                continue
            entry = tier.reserve(key)
            if entry is None:
                return  # every slot is busy: the rest stays in the first tier only
            self._order_save(block, entry, first)

    # -- lookups -------------------------------------------------------------------------------
    def find_prefix(self, request_id: str, block_hashes: list[BlockHash], query_tokens: int) -> int:
        """The leading `block_hashes` the second tier can load; remembered for `allocate_slots`.
        Returns how many."""
        tier = self.tier
        entries = []
        for key in block_hashes:
            entry = tier.lookup(key)
            if entry is None:
                break
            entries.append(entry)
        self.lookup = TierLookup(request_id, entries, len(entries) * self.block_size, [True] * len(entries),
                                 query_tokens=query_tokens)
        return len(entries)

    def find_swapped(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], int] | None:
        """A swapped-out request's blocks: the leading published ones still in the first tier as hits,
        the rest to load. None when the request is not swapped out."""
        state = self.swapped.get(request_id)
        if state is None:
            return None
        block_size = self.block_size
        n_tok = min(state.num_computed_tokens, num_tokens - 1)
        n_blocks = -(-n_tok // block_size)
        table = self.pool.cached_block_hash_to_block
        hits: list[KVCacheBlock] = []
        for entry, published in zip(state.entries[:n_blocks], state.published):
            block = table.get(entry.key) if published and (len(hits) + 1) * block_size <= n_tok else None
            if block is None:
                break
            hits.append(block)
        rest = slice(len(hits), n_blocks)
        self.lookup = TierLookup(request_id, state.entries[rest], n_tok - len(hits) * block_size,
                                 state.published[rest], swap=True)
        return hits, n_tok

    def take_lookup(self, request_id: str) -> TierLookup | None:
        lookup, self.lookup = self.lookup, None
        return lookup if lookup is not None and lookup.request_id == request_id else None

    def order_loads(self, lookup: TierLookup, blocks: list[KVCacheBlock]) -> int:
        """Load the lookup's entries into `blocks` (new, in the request's table) before the forward;
        publish the full hashed ones in the first tier. Returns how many leading blocks were
        published (those count as the request's cached blocks)."""
        tier, table = self.tier, self.pool.cached_block_hash_to_block
        num_published = 0
        for i, (entry, block) in enumerate(zip(lookup.entries, blocks)):
            tier.pin(entry)
            tier.touch(entry)
            self.pending.loads.append((KVTransfer(block.block_id, entry.slot, entry.key), entry))
            full = (i + 1) * self.block_size <= lookup.num_tokens
            if lookup.published[i] and full and num_published == i:
                if entry.key not in table:
                    block.block_hash = entry.key
                    table[entry.key] = block
                num_published += 1
        self.stats.loaded_blocks += len(blocks)
        if lookup.swap:
            self._resume(lookup)
        return num_published

    # -- swap ----------------------------------------------------------------------------------
    def swap_out(self, request_id: str, num_computed_tokens: int, blocks: list[KVCacheBlock],
                 keys: list[BlockHash], published: list[bool]) -> bool:
        """Keep `blocks` (those holding computed tokens) in the second tier for the resume. All or
        nothing: False (the caller recomputes instead) when the second tier has no room."""
        tier = self.tier
        taken: list[tuple[TierEntry, KVCacheBlock | None]] = []
        for block, key in zip(blocks, keys):
            entry = tier.entries.get(key)
            if entry is None:
                entry = tier.reserve(key)
                if entry is None:
                    for e, new_block in taken:
                        tier.unpin(e)
                        if new_block is not None:
                            tier.drop(e)
                            tier.complete(e, ok=False)
                    self.stats.swap_fallbacks += 1
                    return False
                taken.append((entry, block))
            else:
                taken.append((entry, None))
            tier.pin(entry)
        for entry, block in taken:
            if block is not None:
                self._order_save(block, entry, first=True)
        self.swapped[request_id] = SwapState(num_computed_tokens, [e for e, _ in taken], published)
        self.stats.swaps_out += 1
        return True

    def _resume(self, lookup: TierLookup) -> None:
        """The swapped-out request is back: its entries lose their swap pins; private ones are dropped
        (after the step for those it loads, now for the others)."""
        state = self.swapped.pop(lookup.request_id)
        loaded = {id(e) for e in lookup.entries}
        for entry, published in zip(state.entries, state.published):
            self.tier.unpin(entry)
            if not published:
                if id(entry) in loaded:
                    self.pending.drops.append(entry)
                else:
                    self.tier.drop(entry)
        self.stats.swaps_in += 1

    def forget_swapped(self, request_id: str) -> None:
        """A swapped-out request ended without resuming."""
        state = self.swapped.pop(request_id, None)
        if state is None:
            return
        for entry, published in zip(state.entries, state.published):
            self.tier.unpin(entry)
            if not published:
                self.tier.drop(entry)

    # -- the step ------------------------------------------------------------------------------
    def take(self, out: SchedulerOutput) -> None:
        """Hand the pending orders to the step being built."""
        s = self.in_step
        if s.saves or s.saves_first or s.loads or s.drops:
            raise RuntimeError("a step with KV transfers was built before the previous one was done")
        orders, self.pending = self.pending, _StepOrders()
        self.in_step = orders
        out.kv_saves_first = [t for t, _ in orders.saves_first]
        out.kv_saves = [t for t, _, _ in orders.saves]
        out.kv_loads = [t for t, _ in orders.loads]

    def done(self, failed_slots: list[int] = ()) -> None:
        """The step has run: its copies are complete (except the saves into `failed_slots`)."""
        orders, self.in_step = self.in_step, _StepOrders()
        tier, failed = self.tier, set(failed_slots)
        saves = [(t, e, None) for t, e in orders.saves_first] + orders.saves
        for transfer, entry, block in saves:
            if transfer.slot in failed:
                self.stats.failed_saves += 1
                # A swapped-out request that needed this copy recomputes instead.
                for rid in [r for r, s in self.swapped.items() if any(e is entry for e in s.entries)]:
                    self.forget_swapped(rid)
                if entry.dropped or tier.entries.get(entry.key) is entry:
                    tier.complete(entry, ok=False)
            else:
                tier.complete(entry)
                self.stats.saved_blocks += 1
            if block is not None:
                self.pool.free_blocks((block,))  # the copy's reference
        for _, entry in orders.loads:
            tier.unpin(entry)
        for entry in orders.drops:
            if entry.key in tier.entries and entry.pins == 0:
                tier.drop(entry)
