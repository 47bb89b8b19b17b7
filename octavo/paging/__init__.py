"""The paging system: KV blocks, block tables, prefix caching, swap. Pure Python, no torch."""

from octavo.paging.allocator import KVAllocator
from octavo.paging.block_hash import hash_block_tokens
from octavo.paging.block_pool import BlockPool, KVBlock, OutOfKVBlocks
from octavo.paging.contiguous import ContiguousAllocator
from octavo.paging.kv_manager import KVCacheManager
from octavo.paging.waste import WasteTracker

__all__ = [
    "BlockPool",
    "ContiguousAllocator",
    "KVAllocator",
    "KVBlock",
    "KVCacheManager",
    "OutOfKVBlocks",
    "WasteTracker",
    "hash_block_tokens",
]
