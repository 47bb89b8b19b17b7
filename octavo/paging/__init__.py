"""The paging system: KV blocks, block tables, prefix caching, swap. Pure Python, no torch."""

from octavo.paging.allocator import EMPTY_PREFIX, CachedPrefix, KVAllocator, NewBlocks
from octavo.paging.baseline.contiguous import ContiguousAllocator
from octavo.paging.block_hash import BlockHasher, hash_block_tokens
from octavo.paging.block_pool import BlockPool, KVBlock, OutOfKVBlocks
from octavo.paging.kv_manager import KVCacheManager
from octavo.paging.kv_seq import KVSeq
from octavo.paging.waste import WasteTracker

__all__ = [
    "EMPTY_PREFIX",
    "BlockHasher",
    "BlockPool",
    "CachedPrefix",
    "ContiguousAllocator",
    "KVAllocator",
    "KVBlock",
    "KVCacheManager",
    "KVSeq",
    "NewBlocks",
    "OutOfKVBlocks",
    "WasteTracker",
    "hash_block_tokens",
]
