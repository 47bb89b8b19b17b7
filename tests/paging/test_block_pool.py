"""BlockPool: the free queues, the eviction order and the verified hash index."""

from __future__ import annotations

import pytest

from octavo.paging.block_pool import BlockPool, FreeBlockQueue, KVBlock, OutOfKVBlocks

H1, H2, H3 = b"1" * 16, b"2" * 16, b"3" * 16


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def full_cached_block(pool: BlockPool, block_hash: bytes, tokens=(1, 2)) -> KVBlock:
    blk = pool.get_new_block()
    pool.set_filled(blk, len(tokens))
    pool.cache_full_block(blk, block_hash, tokens)
    return blk


def test_free_queue_is_a_linked_list_with_o1_removal_from_the_middle() -> None:
    q = FreeBlockQueue()
    blocks = [KVBlock(i) for i in range(5)]
    for b in blocks:
        q.append(b)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 2]
    with pytest.raises(AssertionError, match="queued twice"):
        q.append(blocks[3])


def test_new_blocks_come_from_the_plain_queue_before_any_cached_block_is_evicted() -> None:
    pool = BlockPool(4, enable_caching=True)
    cached = full_cached_block(pool, H1)
    plain = [pool.get_new_block() for _ in range(3)]
    pool.free([cached, *plain])
    assert pool.num_free_blocks == 4 and pool.num_cached_free_blocks == 1
    assert ids(pool.get_new_block() for _ in range(3)) == ids(plain)
    assert pool.get_cached_block(H1, (1, 2)) is cached, "still findable while plain blocks last"
    assert pool.get_new_block() is cached
    assert pool.get_cached_block(H1, (1, 2)) is None, "an evicted block leaves the index"
    assert cached.block_hash is None and cached.num_filled == 0 and pool.num_evictions == 1
    with pytest.raises(OutOfKVBlocks):
        pool.get_new_block()


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, c = (full_cached_block(pool, h) for h in (H1, H2, H3))
    pool.free([a, b, c])
    pool.touch(a)  # a cache hit takes `a` out of the queue
    pool.free([a])  # ... and freeing it again makes it the most recently freed
    assert ids(pool.iter_free_blocks()) == [b.block_id, c.block_id, a.block_id]
    assert [pool.get_new_block() for _ in range(3)] == [b, c, a]


def test_touch_removes_a_block_from_the_middle_of_the_cached_queue() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, c = (full_cached_block(pool, h) for h in (H1, H2, H3))
    pool.free([a, b, c])
    pool.touch(b)
    assert b.ref_cnt == 1 and ids(pool.iter_free_blocks()) == [a.block_id, c.block_id]
    assert pool.num_live_slots == 2, "a revived block's tokens are live again"
    pool.check_invariants()


def test_touching_a_plain_free_block_is_an_error() -> None:
    pool = BlockPool(1, enable_caching=True)
    with pytest.raises(ValueError, match="holds nothing"):
        pool.touch(pool.blocks[0])


def test_a_hit_needs_matching_tokens_parent_and_extra_key_not_just_the_hash() -> None:
    pool = BlockPool(2, enable_caching=True)
    blk = pool.get_new_block()
    key = pool.cache_full_block(blk, H1, (1, 2), parent_key=0, extra_key="a")
    assert pool.get_cached_block(H1, (1, 2), 0, "a") is blk
    assert pool.get_cached_block(H1, (1, 3), 0, "a") is None
    assert pool.get_cached_block(H1, (1, 2), 7, "a") is None
    assert pool.get_cached_block(H1, (1, 2), 0, None) is None
    twin = pool.get_new_block()
    assert pool.cache_full_block(twin, H1, (1, 2), 0, "a") == key, "an equal block shares the key"
    assert pool.cache_full_block(twin, H1, (9, 9), 0, "a") is None, "a collision is not indexed"
    assert twin.block_hash is None and pool.num_cached_blocks == 1
    pool.free([twin])
    assert pool.num_cached_free_blocks == 0, "an unindexed block is freed as a plain block"


def test_caching_disabled_never_indexes() -> None:
    pool = BlockPool(1, enable_caching=False)
    blk = pool.get_new_block()
    assert pool.cache_full_block(blk, H1, (1, 2)) is None
    assert pool.get_cached_block(H1, (1, 2)) is None
    pool.free([blk])
    assert pool.num_cached_free_blocks == 0


def test_check_invariants_names_the_broken_invariant() -> None:
    pool = BlockPool(2, enable_caching=True)
    blk = pool.get_new_block()
    blk.ref_cnt = 0  # neither free nor referenced
    with pytest.raises(AssertionError, match="either free or referenced"):
        pool.check_invariants()
