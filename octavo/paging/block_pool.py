"""Physical KV blocks: ref counts, the LRU free queues and the prefix-cache index.

A block that drops to ref 0 but holds a cached full block keeps its contents and stays findable
by hash until the pool needs it for something else. Plain free blocks are therefore always handed
out first, and cached ones are evicted least recently freed first. Every operation here is O(1):
the free queues are linked lists threaded through the blocks themselves, so a cached block that
gets hit again leaves the middle of its queue without a scan.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

_FREE, _USED, _SHARED, _CACHED = b"fusc"


class OutOfKVBlocks(RuntimeError):
    """Raised when an operation needs more free KV blocks than exist; it leaves no state behind."""


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block of `block_size` KV slots (eq=False: blocks compare by identity)."""

    block_id: int
    ref_cnt: int = 0
    num_filled: int = 0
    # The token ids of a full block. Kept for every full block of a live sequence (a swap-in needs
    # them to register the block again), and used to verify cache hits against digest collisions.
    token_ids: tuple[int, ...] | None = None
    # Set only while the block is the index entry for that hash.
    block_hash: bytes | None = None
    # Identity of a cached block's contents. Keys are never reused, so "child's parent_key equals
    # the block we hit one position earlier" proves the whole prefix matches, not just one block.
    cache_key: int = 0
    parent_key: int = 0
    extra_key: Hashable | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list through `KVBlock.prev_free/next_free`, with sentinels at both ends."""

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        blk = self._head.next_free
        while blk is not self._tail:
            assert blk is not None, "free queue: broken next_free link"
            yield blk
            blk = blk.next_free

    def append(self, blk: KVBlock) -> None:
        assert blk.prev_free is None and blk.next_free is None, f"block {blk.block_id} queued twice"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = blk
        blk.prev_free = last
        blk.next_free = self._tail
        self._tail.prev_free = blk
        self._len += 1

    def remove(self, blk: KVBlock) -> None:
        prev, nxt = blk.prev_free, blk.next_free
        assert prev is not None and nxt is not None, f"block {blk.block_id} is not queued"
        prev.next_free = nxt
        nxt.prev_free = prev
        blk.prev_free = blk.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        blk = self._head.next_free
        if blk is self._tail or blk is None:
            raise OutOfKVBlocks("free block queue is empty")
        self.remove(blk)
        return blk


class BlockPool:
    """All physical blocks of one device, their free queues and the hash -> block index."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._plain_free = FreeBlockQueue()
        self._cached_free = FreeBlockQueue()
        for blk in self.blocks:
            self._plain_free.append(blk)
        self._index: dict[bytes, KVBlock] = {}
        self._next_cache_key = 1
        # Every block's state as one byte, kept up to date by the calls below so the page map
        # (kv_map.py) never walks the blocks: f free, u ref 1, s ref > 1, c cached and free.
        self.states = bytearray(b"f" * num_blocks)
        # Slots holding tokens in referenced blocks, kept up to date so stats() costs O(1).
        self.num_live_slots = 0
        self.peak_used_blocks = 0
        self.num_evictions = 0
        # The KV tier's hook (tier/kv_tier.py): called with a full indexed block the pool lets
        # go of, when it is freed or, with `offer_on_evict`, only when it is evicted.
        self.tier_offer: Callable[[KVBlock], None] | None = None
        self.offer_on_evict = False

    # -- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._plain_free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def iter_free_blocks(self) -> Iterator[KVBlock]:
        """Free blocks in the order they would be handed out."""
        yield from self._plain_free
        yield from self._cached_free

    # -- allocation -----------------------------------------------------------------------------
    def get_new_block(self) -> KVBlock:
        """An empty block with ref 1: a plain free block if any, else evict the LRU cached one."""
        if len(self._plain_free):
            blk = self._plain_free.popleft()
        else:
            blk = self._cached_free.popleft()
            self._evict(blk)
        blk.ref_cnt = 1
        self.states[blk.block_id] = _USED
        self._note_used()
        return blk

    def touch(self, blk: KVBlock) -> None:
        """Take one more reference; a cached block at ref 0 leaves the free queue (a cache hit)."""
        if blk.ref_cnt == 0:
            if blk.block_hash is None:
                raise ValueError(f"block {blk.block_id} is free and holds nothing to reuse")
            self._cached_free.remove(blk)
            self.num_live_slots += blk.num_filled
            blk.ref_cnt = 1
            self.states[blk.block_id] = _USED
            self._note_used()
        else:
            blk.ref_cnt += 1
            self.states[blk.block_id] = _SHARED

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 are queued in the order given."""
        for blk in blocks:
            assert blk.ref_cnt > 0, f"block {blk.block_id} freed more often than referenced"
            blk.ref_cnt -= 1
            if blk.ref_cnt:
                if blk.ref_cnt == 1:
                    self.states[blk.block_id] = _USED
                continue
            self.num_live_slots -= blk.num_filled
            if blk.block_hash is None:
                blk.num_filled = 0
                blk.token_ids = None
                self._plain_free.append(blk)
                self.states[blk.block_id] = _FREE
            else:
                self._cached_free.append(blk)
                self.states[blk.block_id] = _CACHED
                if self.tier_offer is not None and not self.offer_on_evict:
                    self.tier_offer(blk)

    def set_filled(self, blk: KVBlock, num_filled: int) -> None:
        """Record how many slots of a referenced block hold tokens."""
        self.num_live_slots += num_filled - blk.num_filled
        blk.num_filled = num_filled

    def _note_used(self) -> None:
        used = self.num_used_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used

    def _evict(self, blk: KVBlock) -> None:
        assert blk.block_hash is not None
        if self.tier_offer is not None and self.offer_on_evict:
            self.tier_offer(blk)
        del self._index[blk.block_hash]
        blk.block_hash = blk.token_ids = blk.extra_key = None
        blk.cache_key = blk.parent_key = blk.num_filled = 0
        self.num_evictions += 1

    def uncache(self, blk: KVBlock) -> None:
        """Drop a block's cache entry: its KV was never computed (a failed step). A free one
        becomes a plain free block."""
        if blk.block_hash is not None and self._index.get(blk.block_hash) is blk:
            del self._index[blk.block_hash]
        if blk.ref_cnt == 0 and blk.block_hash is not None:
            self._cached_free.remove(blk)
            blk.num_filled = 0
            blk.token_ids = None
            self._plain_free.append(blk)
            self.states[blk.block_id] = _FREE
        blk.block_hash = blk.extra_key = None
        blk.cache_key = blk.parent_key = 0

    # -- prefix cache ---------------------------------------------------------------------------
    def get_cached_block(
        self,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent_key: int | None = 0,
        extra_key: Hashable | None = None,
    ) -> KVBlock | None:
        """The cached block for this content, or None. A digest match alone is not trusted: the
        stored token ids, extra key and parent identity must match too (parent_key None: the
        caller cannot know the parent, which only a sliding window's first block may ask)."""
        blk = self._index.get(block_hash)
        if (
            blk is None
            or blk.token_ids != token_ids
            or parent_key is not None and blk.parent_key != parent_key
            or blk.extra_key != extra_key
        ):
            return None
        return blk

    def get_block_by_key(self, block_hash: bytes, cache_key: int | None) -> KVBlock | None:
        """The block indexed under `block_hash` if it is still registration `cache_key`."""
        blk = self._index.get(block_hash)
        if blk is None or cache_key is None or blk.cache_key != cache_key:
            return None
        return blk

    def cache_full_block(
        self,
        blk: KVBlock,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent_key: int = 0,
        extra_key: Hashable | None = None,
    ) -> int | None:
        """Record a full block's tokens and make it findable by hash.

        Returns the cache key that identifies this content: the block's own new key, the key of
        an identical block already indexed (this one then stays out of the index: one entry per
        hash), or None when the hash is taken by different contents (a digest collision) or
        caching is off. Children chain onto the returned key.
        """
        blk.token_ids = token_ids
        if not self.enable_caching:
            return None
        existing = self._index.get(block_hash)
        if existing is None:
            blk.block_hash = block_hash
            blk.parent_key = parent_key
            blk.extra_key = extra_key
            blk.cache_key = self._next_cache_key
            self._next_cache_key += 1
            self._index[block_hash] = blk
            return blk.cache_key
        if (
            existing.token_ids == token_ids
            and existing.parent_key == parent_key
            and existing.extra_key == extra_key
        ):
            return existing.cache_key
        return None

    # -- checks ---------------------------------------------------------------------------------
    def check_invariants(self, states: bool = True) -> None:
        """`states`: also check the state bytes (check_states; KVCacheManager checks them
        last, after the ref counts they follow)."""
        queued: set[int] = set()
        for name, queue, cached in (
            ("plain free queue", self._plain_free, False),
            ("cached free queue", self._cached_free, True),
        ):
            count = 0
            prev = queue._head
            for blk in queue:
                assert blk.prev_free is prev, f"{name}: block {blk.block_id} has a stale prev link"
                assert blk.block_id not in queued, f"{name}: block {blk.block_id} queued twice"
                queued.add(blk.block_id)
                assert blk.ref_cnt == 0, f"{name}: block {blk.block_id} has ref {blk.ref_cnt}"
                assert (blk.block_hash is not None) == cached, (
                    f"{name}: block {blk.block_id} in the wrong queue (hash={blk.block_hash!r})"
                )
                if not cached:
                    assert blk.num_filled == 0, f"{name}: block {blk.block_id} still filled"
                prev = blk
                count += 1
            assert queue._tail.prev_free is prev, f"{name}: tail link broken"
            assert count == len(queue), f"{name}: length {len(queue)} but {count} linked"
        live = 0
        for blk in self.blocks:
            assert blk.ref_cnt >= 0, f"block {blk.block_id}: negative ref count"
            free = blk.block_id in queued
            assert free != (blk.ref_cnt > 0), (
                f"block {blk.block_id}: must be either free or referenced (ref={blk.ref_cnt}, "
                f"queued={free})"
            )
            if blk.ref_cnt:
                live += blk.num_filled
            if blk.block_hash is not None:
                assert self._index.get(blk.block_hash) is blk, (
                    f"block {blk.block_id} has a hash but is not its index entry"
                )
        for block_hash, blk in self._index.items():
            assert blk.block_hash == block_hash, f"index entry {blk.block_id}: hash mismatch"
            assert blk.cache_key > 0 and blk.token_ids is not None, (
                f"index entry {blk.block_id} lacks a cache key or token ids"
            )
        assert live == self.num_live_slots, (
            f"live slot counter {self.num_live_slots} != {live} counted"
        )
        if states:
            self.check_states()

    def check_states(self) -> None:
        """Each state byte agrees with its block's ref count and hash."""
        for blk in self.blocks:
            state = (_FREE if blk.block_hash is None else _CACHED) if not blk.ref_cnt else (
                _USED if blk.ref_cnt == 1 else _SHARED)
            assert self.states[blk.block_id] == state, (
                f"block {blk.block_id}: state byte {chr(self.states[blk.block_id])!r}, but ref "
                f"{blk.ref_cnt} and {'a' if blk.block_hash else 'no'} hash make it {chr(state)!r}")
