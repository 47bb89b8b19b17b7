"""A new sequence's cached prefix: which of its full blocks every KV cache group can reuse.

A pure query on the pool (no references taken, no stats counted): KVCacheManager registers
blocks as they fill and takes the references when `allocate_slots` starts the sequence. Hits
are verified against the stored token ids, extra key and parent identity.
"""

from __future__ import annotations

from octavo.paging.allocator import CachedPrefix
from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.kv_seq import KVSeq


class PrefixLookup:
    """KVCacheManager's prefix-cache queries (a mixin: the manager owns the state)."""

    block_size: int
    windows: tuple[int | None, ...]
    block_pool: BlockPool
    enable_prefix_caching: bool
    _anchor: int | None
    _group_order: list[int]
    _no_hit: CachedPrefix

    def get_computed_blocks(self, seq: KVSeq) -> CachedPrefix:
        """Cached blocks covering the longest full-block prefix of a new sequence that every
        group can resume from, leaving at least one token to compute. A full-attention group
        needs every block of the prefix, a sliding group only those its window still sees.
        A pure query: no references taken, no stats counted."""
        if not self.enable_prefix_caching:
            return self._no_hit
        n = min((len(seq.token_ids) - 1) // self.block_size, len(seq.block_hashes))
        found: list[list[KVBlock | None]] = [[] for _ in self.windows]
        while True:  # each group may shorten the hit; stop when none does
            before = n
            for g in self._group_order:
                if self.windows[g] is None:
                    found[g] = self._full_hits(seq, g, n)
                else:
                    anchor = None if self._anchor is None else found[self._anchor]
                    found[g] = self._window_hits(seq, g, n, anchor)
                n = min(n, len(found[g]))
            if n == before:
                break
        if n == 0:
            return self._no_hit
        return CachedPrefix(tuple(tuple(hits[:n]) for hits in found), n * self.block_size)

    def _block_tokens(self, seq: KVSeq, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(seq.token_ids[i * bs : (i + 1) * bs])

    def _full_hits(self, seq: KVSeq, g: int, n: int) -> list[KVBlock | None]:
        """The leading blocks of `seq` cached in `g`, each chained onto the one before."""
        hits: list[KVBlock | None] = []
        parent_key = 0
        for i in range(n):
            blk = self.block_pool.get_cached_block(
                self._key(seq.block_hashes[i], g), self._block_tokens(seq, i), parent_key,
                seq.extra_key)
            if blk is None:
                break
            hits.append(blk)
            parent_key = blk.cache_key
        return hits

    def _window_hits(self, seq: KVSeq, g: int, n: int,
                     anchor: list[KVBlock | None] | None) -> list[KVBlock | None]:
        """The longest prefix of at most `n` blocks whose blocks in `g`'s window of the next
        query are all cached (None before the window), scanning from the right once.

        In a hybrid model each sliding block was registered as the child of the anchor group's
        block at the same position, whose chain vouches for the whole prefix. Where every group
        slides, consecutive hits must chain onto each other; the first block of the window is
        named by its prefix's digest alone (the blocks before it are gone)."""
        pool = self.block_pool
        end = n
        hits: dict[int, KVBlock] = {}  # verified so far, by block index
        while end > 0:
            first = self._first_live(g, end * self.block_size)
            for i in range(end - 1, first - 1, -1):
                parent = None if anchor is None else anchor[i].cache_key  # type: ignore[union-attr]
                blk = hits.get(i) or pool.get_cached_block(
                    self._key(seq.block_hashes[i], g), self._block_tokens(seq, i), parent,
                    seq.extra_key)
                if blk is None:
                    end = i  # no hit may include block i
                    break
                nxt = hits.get(i + 1) if i + 1 < end else None
                if anchor is None and nxt is not None and nxt.parent_key != blk.cache_key:
                    end = i + 1  # blocks i and i + 1 do not chain: a hit may end at i + 1
                    break
                hits[i] = blk
            else:
                return [hits[j] if j >= first else None for j in range(end)]
        return []
