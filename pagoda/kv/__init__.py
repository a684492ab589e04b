"""Layer 3, state: the paged KV block pool, the KV cache manager and prefix caching by block hash."""

from pagoda.kv.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVCacheBlock
from pagoda.kv.hashing import ROOT_HASH, hash_block_tokens, sha256_hash_block_tokens
from pagoda.kv.manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "NULL_BLOCK_ID",
    "ROOT_HASH",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
    "sha256_hash_block_tokens",
]
