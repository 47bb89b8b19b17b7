"""ContiguousAllocator: first fit, coalescing, and the waste it is there to show."""

from __future__ import annotations

import pytest

from octavo.paging import ContiguousAllocator, OutOfKVBlocks

BS = 4


def test_reserves_max_model_len_first_fit_and_counts_external_fragmentation() -> None:
    # 10 blocks; every sequence reserves 12 tokens = 3 blocks.
    c = ContiguousAllocator(10, BS, max_model_len=12)
    for seq in (1, 2, 3):
        c.allocate(seq, [0] * 5, 5, final_tokens=6)
    assert [c.block_table(s) for s in (1, 2, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    s = c.stats()
    assert s["kv_slots_live"] == 15
    assert s["kv_slots_internal_waste"] == 3 * (12 - 6), "beyond the final length"
    assert s["kv_slots_reserved_waste"] == 3 * (6 - 5), "held for the one token still to come"
    assert s["kv_slots_external_waste"] == 4, "block 9 alone cannot hold a 3-block reservation"
    assert s["kv_slots_free"] == 0
    c.free(2)
    s = c.stats()
    assert s["kv_slots_free"] == 12 and s["kv_slots_external_waste"] == 4
    c.allocate(4, [0], 1)
    assert c.block_table(4) == [3, 4, 5], "first fit takes the hole left by seq 2"
    c.check_invariants()


def test_fragmented_free_space_cannot_hold_a_reservation() -> None:
    c2 = ContiguousAllocator(8, BS, max_model_len=12)  # 3-block reservations
    for seq in range(2):
        c2.allocate(seq, [0], 1)
    c2.free(0)  # free extents: [0, 3) and [6, 8)
    assert c2.num_free_blocks() == 5
    assert c2.stats()["kv_slots_external_waste"] == 2 * BS
    assert c2.can_allocate([0], 1)
    c2.allocate(9, [0], 1)
    assert not c2.can_allocate([0], 1), "2 free blocks, but a reservation needs 3 in a row"
    with pytest.raises(OutOfKVBlocks, match="no free extent of 3 contiguous blocks"):
        c2.allocate(10, [0], 1)
    c2.check_invariants()


def test_free_extents_coalesce() -> None:
    c = ContiguousAllocator(9, BS, max_model_len=12)
    for seq in range(3):
        c.allocate(seq, [0], 1)
    for seq in (0, 2, 1):
        c.free(seq)
        c.check_invariants()
    assert c.stats()["kv_slots_free"] == 9 * BS and c.num_free_blocks() == 9
    c.allocate(5, [0], 1)
    assert c.block_table(5) == [0, 1, 2]


def test_reserve_request_sizes_by_reserve_tokens() -> None:
    c = ContiguousAllocator(16, BS, max_model_len=64, reserve="request")
    c.allocate(1, [0] * 6, 6, reserve_tokens=10)  # 3 blocks
    c.allocate(2, [0] * 3, 3, reserve_tokens=8)  # 2 blocks
    assert c.block_table(1) == [0, 1, 2] and c.block_table(2) == [3, 4]
    c.allocate(3, [0] * 3, 3, reserve_tokens=40)  # 10 blocks
    c.free(2)
    # Free extents: [3, 5) of 2 blocks and [15, 16) of 1; the smallest reservation is 2 blocks.
    assert c.stats()["kv_slots_external_waste"] == 1 * BS
    with pytest.raises(ValueError, match="reserve_tokens"):
        c.allocate(4, [0], 1)
    with pytest.raises(ValueError, match="exceed"):
        c.allocate(4, [0] * 9, 9, reserve_tokens=8)
    c.check_invariants()


def test_append_never_allocates_and_fails_past_the_reservation() -> None:
    c = ContiguousAllocator(4, BS, max_model_len=8)
    tokens = [0] * 7
    c.allocate(1, tokens, 7)
    assert c.can_append_slots(1, 1) and not c.can_append_slots(1, 2)
    c.append_slots(1, [*tokens, 1], 1)
    free_before = c.num_free_blocks()
    with pytest.raises(OutOfKVBlocks, match="outgrew"):
        c.append_slots(1, [*tokens, 1, 2], 1)
    assert c.num_computed_tokens(1) == 8 and c.num_free_blocks() == free_before


def test_no_sharing_no_prefix_cache_no_swap() -> None:
    c = ContiguousAllocator(4, BS, max_model_len=8)
    c.allocate(1, [1, 2, 3, 4, 5], 5)
    assert c.find_cached_prefix([1, 2, 3, 4, 5]) == 0
    with pytest.raises(NotImplementedError, match="cannot fork"):
        c.fork(1, 2)
    assert not c.can_swap_out([1]) and not c.can_swap_in([1])
    with pytest.raises(NotImplementedError):
        c.swap_out([1])
    assert c.take_block_copies() == []
