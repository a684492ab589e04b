"""Chained block hashes: the key under which a full block's KV is found again by a later request.

A block's hash covers its parent's hash, its own token ids and the request's extra keys (cache salt,
adapter id), so equal hashes mean "same tokens at the same positions behind the same prefix, under the
same adapter/salt". Partial blocks are never hashed: their content is not final.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

BlockHash = int
BlockHasher = Callable[[BlockHash | None, Sequence[int], tuple], BlockHash]

# The parent of a request's first block. A fixed int (not None, whose hash is id-based before
# Python 3.12) so the chain is the same in every process for the same tokens.
ROOT_HASH: BlockHash = 0x5061676F6461  # "Pagoda"


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Fast default: the builtin hash of a tuple (64-bit, not collision-resistant against an adversary)."""
    if parent_hash is None:
        parent_hash = ROOT_HASH
    return hash((parent_hash, tuple(token_ids), extra_keys))


def sha256_hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Collision-resistant variant (about 1 µs a block) for multi-tenant servers.

    Extra keys go through repr(), so they must have a stable repr (str, int, tuples of them).
    """
    if parent_hash is None:
        parent_hash = ROOT_HASH
    h = hashlib.sha256(parent_hash.to_bytes(32, "little", signed=True))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    # Keep 128 bits: ample against collisions, cheaper to hash and compare as a dict key than 256.
    return int.from_bytes(h.digest()[:16], "little", signed=True)
