"""ContiguousAllocator: first fit, coalescing, and the waste it is there to show."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from octavo.paging import EMPTY_PREFIX, BlockHasher, ContiguousAllocator, KVSeq, NewBlocks

BS = 4


def seq(seq_id: int, tokens: Iterable[int]) -> KVSeq:
    return KVSeq(seq_id, tokens, hasher=BlockHasher(BS))


def start(c: ContiguousAllocator, s: KVSeq, n: int, **kw) -> None:
    """Reserve `s`'s buffer and give its first `n` tokens their slots; must succeed."""
    new = c.allocate_slots(s, n, c.get_computed_blocks(s), **kw)
    assert new is not None, f"could not start sequence {s.seq_id}"
    assert new == NewBlocks(0, c.block_table(s.seq_id)), "a start returns the whole reservation"
    assert s.num_computed_tokens == n


def snapshot(c: ContiguousAllocator, seqs: Iterable[KVSeq]) -> tuple:
    seqs = tuple(seqs)
    return (
        c.stats(),
        {s.seq_id: c.block_table(s.seq_id) for s in seqs},
        {s.seq_id: s.num_computed_tokens for s in seqs},
        c.num_free_blocks(),
        list(c._free),
    )


def test_reserves_max_model_len_first_fit_and_counts_external_fragmentation() -> None:
    # 10 blocks; every sequence reserves 12 tokens = 3 blocks.
    c = ContiguousAllocator(10, BS, max_model_len=12)
    for i in (1, 2, 3):
        start(c, seq(i, [0] * 5), 5, final_tokens=6)
    assert [c.block_table(s) for s in (1, 2, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    st = c.stats()
    assert st["kv_slots_live"] == 15
    assert st["kv_slots_internal_waste"] == 3 * (12 - 6), "beyond the final length"
    assert st["kv_slots_reserved_waste"] == 3 * (6 - 5), "held for the one token still to come"
    assert st["kv_slots_external_waste"] == 4, "block 9 alone cannot hold a 3-block reservation"
    assert st["kv_slots_free"] == 0
    c.free(2)
    st = c.stats()
    assert st["kv_slots_free"] == 12 and st["kv_slots_external_waste"] == 4
    start(c, seq(4, [0]), 1)
    assert c.block_table(4) == [3, 4, 5], "first fit takes the hole left by seq 2"
    c.check_invariants()


def test_fragmented_free_space_cannot_hold_a_reservation() -> None:
    c2 = ContiguousAllocator(8, BS, max_model_len=12)  # 3-block reservations
    seqs = [seq(i, [0]) for i in range(2)]
    for s in seqs:
        start(c2, s, 1)
    c2.free(0)  # free extents: [0, 3) and [6, 8)
    assert c2.num_free_blocks() == 5
    assert c2.stats()["kv_slots_external_waste"] == 2 * BS
    s9 = seq(9, [0])
    start(c2, s9, 1)  # fits in [0, 3)
    live = (seqs[1], s9)
    before = snapshot(c2, live)
    s10 = seq(10, [0])
    assert c2.num_free_blocks() == 2
    assert c2.allocate_slots(s10, 1, c2.get_computed_blocks(s10)) is None, (
        "2 free blocks, but a reservation needs 3 in a row"
    )
    st = c2.stats()
    assert st["kv_slots_free"] == 0 and st["kv_slots_external_waste"] == 2 * BS, (
        "no free extent of 3 contiguous blocks"
    )
    assert snapshot(c2, live) == before and s10.num_computed_tokens == 0
    with pytest.raises(KeyError):
        c2.block_table(10)
    c2.check_invariants()


def test_free_extents_coalesce() -> None:
    c = ContiguousAllocator(9, BS, max_model_len=12)
    seqs = [seq(i, [0]) for i in range(3)]
    for s in seqs:
        start(c, s, 1)
    for i in (0, 2, 1):
        c.free(i)
        assert seqs[i].num_computed_tokens == 0
        c.check_invariants()
    assert c.stats()["kv_slots_free"] == 9 * BS and c.num_free_blocks() == 9
    start(c, seq(5, [0]), 1)
    assert c.block_table(5) == [0, 1, 2]


def test_reserve_request_sizes_by_reserve_tokens() -> None:
    c = ContiguousAllocator(16, BS, max_model_len=64, reserve="request")
    s1, s2, s3 = seq(1, [0] * 6), seq(2, [0] * 3), seq(3, [0] * 3)
    start(c, s1, 6, reserve_tokens=10)  # 3 blocks
    start(c, s2, 3, reserve_tokens=8)  # 2 blocks
    assert c.block_table(1) == [0, 1, 2] and c.block_table(2) == [3, 4]
    start(c, s3, 3, reserve_tokens=40)  # 10 blocks
    c.free(2)
    # Free extents: [3, 5) of 2 blocks and [15, 16) of 1; the smallest reservation is 2 blocks.
    assert c.stats()["kv_slots_external_waste"] == 1 * BS
    before = snapshot(c, (s1, s3))
    with pytest.raises(ValueError, match="reserve_tokens"):
        c.allocate_slots(seq(4, [0]), 1)
    with pytest.raises(ValueError, match="exceed"):
        c.allocate_slots(seq(4, [0] * 9), 9, reserve_tokens=8)
    assert snapshot(c, (s1, s3)) == before
    c.check_invariants()


def test_append_never_allocates_and_fails_past_the_reservation() -> None:
    c = ContiguousAllocator(4, BS, max_model_len=8)
    s = seq(1, [0] * 7)
    start(c, s, 7)
    free_before = c.num_free_blocks()
    s.extend([1, 2])
    before = snapshot(c, [s])
    assert c.allocate_slots(s, 2) is None, "9 tokens do not fit the 8-slot reservation"
    assert snapshot(c, [s]) == before
    assert c.allocate_slots(s, 1) == NewBlocks(2, []), "inside the reservation: no new blocks"
    assert s.num_computed_tokens == 8 and c.num_free_blocks() == free_before
    full = snapshot(c, [s])
    assert c.allocate_slots(s, 1) is None, "it outgrew its reservation"
    assert s.num_computed_tokens == 8 and c.num_free_blocks() == free_before
    assert snapshot(c, [s]) == full


def test_no_sharing_no_prefix_cache_no_swap() -> None:
    c = ContiguousAllocator(4, BS, max_model_len=8)
    s = seq(1, [1, 2, 3, 4, 5])
    start(c, s, 5)
    assert c.get_computed_blocks(seq(2, [1, 2, 3, 4, 5])) == EMPTY_PREFIX
    assert EMPTY_PREFIX.num_tokens == 0
    before = snapshot(c, [s])
    child = KVSeq(2, s.token_ids, num_computed_tokens=s.num_computed_tokens)
    with pytest.raises(NotImplementedError, match="cannot fork"):
        c.fork(1, child)
    assert c.swap_out([1]) is None, "a contiguous buffer is preempted by recomputation"
    with pytest.raises(ValueError, match="never swaps out"):
        c.swap_in([1])
    assert snapshot(c, [s]) == before
    with pytest.raises(KeyError):
        c.block_table(2)
    assert c.take_block_copies() == []


def test_allocate_slots_rejects_an_id_in_use() -> None:
    c = ContiguousAllocator(4, BS, max_model_len=8)
    start(c, seq(1, [0] * 5), 5)
    with pytest.raises(ValueError, match="already"):
        c.allocate_slots(seq(1, [0] * 5), 5)


def test_check_invariants_catches_an_overflowing_reservation() -> None:
    c = ContiguousAllocator(4, BS, max_model_len=8)
    s = seq(1, [0] * 5)
    start(c, s, 5)
    s.num_computed_tokens = 9
    with pytest.raises(AssertionError, match="overflow"):
        c.check_invariants()
