"""Where tier records live: the interface every backend answers (`TierStore`) and the shared
errors. A backend stores opaque records under block keys; checking them is record.py's job.

Backends: the disk (disk_store.py: one file per block in a directory several servers may
share) and Redis/Valkey (engine/redis_tier.py, for replicas on several machines).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class TierStore(Protocol):
    """Records by key. Every method may be called from the engine thread and the writer thread
    at once. Reads and writes never raise for a missing or unreadable record: they answer
    None / False and the caller falls back to recomputing."""

    name: str

    def contains(self, key: bytes) -> bool:
        """Whether a record is believed to exist (a later `get` may still miss)."""
        ...

    def count_leading(self, keys: Sequence[bytes]) -> int:
        """How many of the leading `keys` `contains` (one round trip for a remote store)."""
        ...

    def get(self, key: bytes) -> bytearray | None:
        """The record, or None (missing, vanished, unreadable)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        """`get` of each key (one round trip for a remote store)."""
        ...

    def put(self, key: bytes, parts: Sequence[bytes | memoryview], size: int) -> bool:
        """Store a record given as buffers, atomically (a reader sees all of it or none).
        False when it was there already or could not be written (the reason is logged and
        counted)."""
        ...

    def remove(self, key: bytes) -> None:
        """Drop a record found corrupt (missing already: nothing to do)."""
        ...

    def stats(self) -> dict[str, int]:
        """Occupancy: `tier_bytes`, `tier_blocks`, `tier_bytes_limit` (0: the backend's own
        bound), `tier_evictions`, `tier_write_errors`."""
        ...

    def close(self) -> None: ...
