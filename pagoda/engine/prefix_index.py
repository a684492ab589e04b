"""PrefixIndex: an approximate, bounded map of which replica holds which prompt prefixes, for routing.

Prefixes are keyed by the engine's chained block hashes (`pagoda.kv.hashing`): a block's hash covers
every token before it, so "replica r holds the first k blocks of this prompt" is "the first k of
the prompt's block hashes are in r's set". Each replica's set is kept from two sources:

- what the router sent it (inserted when it routes, so that a burst of requests sharing a new
  prefix follows the first one before the replica has computed anything), and
- what the replica reports (`KVCacheEvents`: blocks its prefix cache published and evicted), which
  corrects the guesses: an evicted prefix stops attracting requests.

Each replica's set is an LRU bounded by `max_blocks` entries, so memory stays bounded whatever the
replicas report. The standalone router (`pagoda.serve.router_app`), which cannot read its backends'
caches, feeds the same index from the prompts it routes alone, hashing bytes of text.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pagoda.contracts.messages import KVCacheEvents
from pagoda.kv.hashing import BlockHash, hash_block_tokens

DEFAULT_MAX_BLOCKS = 1 << 17  # per replica: about 130k hashes (~15 MB), far more than a replica caches


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()) -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids`, as the engine core computes them."""
    out: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]), extra_keys)
        out.append(parent)
    return out


class PrefixIndex:
    """Per replica, the block hashes it probably holds (bounded LRU sets)."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._sets: dict[int, OrderedDict[BlockHash, None]] = {}

    def _set(self, replica: int) -> OrderedDict[BlockHash, None]:
        return self._sets.setdefault(replica, OrderedDict())

    def num_blocks(self, replica: int) -> int:
        return len(self._sets.get(replica, ()))

    def match(self, replica: int, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` the replica holds; those found become recently used."""
        held = self._sets.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            held.move_to_end(h)
            n += 1
        return n

    def insert(self, replica: int, hashes: Sequence[BlockHash]) -> None:
        held = self._set(replica)
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def remove(self, replica: int, hashes: Sequence[BlockHash]) -> None:
        held = self._sets.get(replica)
        if held:
            for h in hashes:
                held.pop(h, None)

    def clear(self, replica: int) -> None:
        """The replica holds nothing (it restarted, or its cache was reset)."""
        self._sets.pop(replica, None)

    def apply_events(self, replica: int, events: KVCacheEvents) -> None:
        if events.cleared:
            self.clear(replica)
        self.remove(replica, events.removed)
        self.insert(replica, events.stored)
