"""The KV tier below the pool: full prefix-cache blocks saved to a store (a directory on disk,
or Redis/Valkey) and loaded back instead of recomputed, across evictions, restarts and
servers. kv_tier.py is the KV manager's part, record.py the bytes of a block, store.py the
backends' interface, disk_store.py the disk backend, writer.py the background writer."""

from octavo.paging.tier.disk_store import DiskStore
from octavo.paging.tier.kv_tier import WRITE_POLICIES, KVTier, TierBlock
from octavo.paging.tier.store import TierStore

__all__ = ["WRITE_POLICIES", "DiskStore", "KVTier", "TierBlock", "TierStore"]
