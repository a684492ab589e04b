"""The second KV tier's bookkeeping: which keys (block hashes) it holds, in which slot, in LRU order,
and which of its slots are being written or read.

No bytes live here. The execution layer owns the slots' memory (host RAM, or files on a local disk)
and carries out the copies that the step orders (`contracts.step.KVTransfer`). An entry is

- saving: a copy into its slot is ordered or in flight; it is neither read nor evicted;
- ready: readable; evictable (least recently used first) unless pinned.

Pins: a load ordered for a step (until that step has run) and a swapped-out request (until it
resumes or ends) pin the entries they need, so the slot is not handed to another key meanwhile.
An entry dropped while it is saving is only marked: its slot is freed when the copy completes,
so two copies never target one slot at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagoda.kv.hashing import BlockHash


class TierEntry:
    __slots__ = ("key", "slot", "ready", "pins", "dropped")

    def __init__(self, key: BlockHash, slot: int, ready: bool) -> None:
        self.key = key
        self.slot = slot
        self.ready = ready
        self.pins = 0
        self.dropped = False  # dropped while saving: forgotten when the copy completes

    def __repr__(self) -> str:
        return f"TierEntry(slot={self.slot}, ready={self.ready}, pins={self.pins}, dropped={self.dropped})"


@dataclass
class OffloadStats:
    """Counters of the second tier, since the start (tokens, blocks, swaps)."""

    queries: int = 0  # prompt tokens looked up in the second tier (those the first tier missed)
    hits: int = 0  # prompt tokens loaded from it instead of computed
    saved_blocks: int = 0  # copies first tier -> second tier completed
    loaded_blocks: int = 0  # copies second tier -> first tier ordered (they run before the forward)
    failed_saves: int = 0
    swaps_out: int = 0  # preemptions whose blocks went to the second tier
    swaps_in: int = 0  # swapped-out requests resumed from it
    swap_fallbacks: int = 0  # swap preemptions that recomputed instead (no room in the second tier)


class SecondTier:
    """`num_slots` slots of one block each, keyed by block hash; LRU eviction of ready, unpinned entries."""

    def __init__(self, num_slots: int, name: str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"the second KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.name = name
        self.entries: dict[BlockHash, TierEntry] = {}
        # Ready and unpinned entries, least recently used first: the eviction candidates.
        self.lru: OrderedDict[BlockHash, TierEntry] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))  # a stack: lowest slot on top
        self._dropped: list[TierEntry] = []  # dropped while saving, by slot still busy

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def free_slot_ids(self) -> list[int]:
        return list(self._free_slots)

    def lookup(self, key: BlockHash) -> TierEntry | None:
        """The entry under `key` when it can be read (ready), else None."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.ready else None

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.entries

    def reserve(self, key: BlockHash) -> TierEntry | None:
        """A new saving entry for `key`, in a free slot or the least recently used one's; None when
        every slot is busy (saving, pinned)."""
        if key in self.entries:
            raise ValueError(f"key {key} is already in the second tier")
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self.lru:
            _, victim = self.lru.popitem(last=False)
            del self.entries[victim.key]
            slot = victim.slot
        else:
            return None
        entry = TierEntry(key, slot, ready=False)
        self.entries[key] = entry
        return entry

    def complete(self, entry: TierEntry, ok: bool = True) -> None:
        """The copy into `entry`'s slot finished (or failed, which forgets the entry)."""
        if entry.ready:
            raise RuntimeError(f"{entry} completed twice")
        if entry.dropped:
            self._dropped.remove(entry)
            self._free_slots.append(entry.slot)
            return
        if not ok:
            del self.entries[entry.key]
            self._free_slots.append(entry.slot)
            return
        entry.ready = True
        if entry.pins == 0:
            self.lru[entry.key] = entry

    def restore(self, key: BlockHash, slot: int) -> None:
        """A ready entry found in persistent storage at start-up (the most recently used last)."""
        if key in self.entries:
            raise ValueError(f"key {key} restored twice")
        self._free_slots.remove(slot)
        entry = TierEntry(key, slot, ready=True)
        self.entries[key] = entry
        self.lru[key] = entry

    def pin(self, entry: TierEntry) -> None:
        if entry.pins == 0 and entry.ready:
            del self.lru[entry.key]
        entry.pins += 1

    def unpin(self, entry: TierEntry) -> None:
        if entry.pins <= 0:
            raise RuntimeError(f"{entry} unpinned more often than pinned")
        entry.pins -= 1
        if entry.pins == 0 and entry.ready and not entry.dropped:
            self.lru[entry.key] = entry  # used just now: the most recently used

    def touch(self, entry: TierEntry) -> None:
        """A read: the entry becomes the most recently used."""
        if entry.key in self.lru:
            self.lru.move_to_end(entry.key)

    def drop(self, entry: TierEntry) -> None:
        """Forget an unpinned entry (a swapped-out request's private block, no longer needed)."""
        if entry.pins:
            raise RuntimeError(f"dropping pinned {entry}")
        del self.entries[entry.key]
        if not entry.ready:
            entry.dropped = True
            self._dropped.append(entry)
            return
        self.lru.pop(entry.key, None)
        self._free_slots.append(entry.slot)

    def check(self) -> None:
        """Raise AssertionError unless every slot is in exactly one place (for tests)."""
        used = [e.slot for e in self.entries.values()] + [e.slot for e in self._dropped]
        assert len(set(used)) == len(used), "a slot held twice"
        assert not set(used) & set(self._free_slots), "a held slot is also free"
        assert len(used) + len(self._free_slots) == self.num_slots, "slots lost"
        assert len(set(self._free_slots)) == len(self._free_slots), "a free slot twice"
        for key, entry in self.entries.items():
            assert entry.key == key and not entry.dropped and entry.pins >= 0
            assert (key in self.lru) == (entry.ready and entry.pins == 0), f"LRU out of sync: {entry}"
        assert all(self.entries.get(k) is e for k, e in self.lru.items())
        assert all(e.dropped and not e.ready for e in self._dropped)
