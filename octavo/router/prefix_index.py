"""What the router believes one replica's prefix cache holds: a bounded LRU set of block hashes.

The router cannot see a replica's cache; it records the full-block hashes of every prompt it
sent there and forgets the least recently sent ones past a capacity (the replica's KV blocks).
Chained hashes name whole prefixes, so a match is the run of a prompt's LEADING hashes found
here. A prompt's blocks are recorded tail first, so when the capacity bites, a prefix loses its
last blocks before its first ones (as the engine frees a sequence's blocks tail first) and a
shorter prefix still matches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    __slots__ = ("capacity", "_lru")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix index needs a capacity of at least 1 block, got "
                             f"{capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def match(self, block_hashes: Sequence[bytes]) -> int:
        """How many of the leading `block_hashes` are here (stops at the first missing one)."""
        n = 0
        for h in block_hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, block_hashes: Sequence[bytes]) -> None:
        """Record a prompt sent to this replica: its blocks become the most recent, the first
        block most recent of all; the least recent blocks past the capacity are forgotten."""
        lru = self._lru
        for h in reversed(block_hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def resize(self, capacity: int) -> None:
        """A new capacity (the replica's KV blocks, once known); forgets the oldest past it."""
        if capacity < 1:
            raise ValueError(f"a prefix index needs a capacity of at least 1 block, got "
                             f"{capacity}")
        self.capacity = capacity
        while len(self._lru) > capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()
