"""Sliding-window paging in KVCacheManager: out-of-window blocks go back to the pool, hybrid
layouts (full + sliding groups), fork/copy-on-write and swap with freed entries.

Prefix hits that only need the window are in test_kv_windows_prefix.py, the random walk over all
of it (checked against a fake KV cache) in test_kv_windows_stateful.py; the helpers they share
in kv_windows_helpers.py.

A query at position p sees keys at positions (p - W, p], so once a sequence has computed n
tokens, the next query (at n) can still see the blocks from max(0, n - W + 1) // bs on.
"""

from __future__ import annotations

import pytest

from octavo.paging import KVCacheManager, KVSeq
from tests.paging.kv_windows_helpers import (
    _cdiv,
    assert_all_returned,
    assert_trimmed,
    decode,
    first_live,
    held,
    mkseq,
    snapshot,
    start,
)


# -- 1. pure sliding: the window bounds what one sequence holds ---------------------------------
@pytest.mark.parametrize("bs", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("wmul", [1, 2, 4])
@pytest.mark.parametrize("off", [0, -1, 1])  # W a multiple of bs, or not
@pytest.mark.parametrize("caching", [True, False])
def test_decoding_far_past_the_window_holds_a_bounded_number_of_blocks(
    bs: int, wmul: int, off: int, caching: bool
) -> None:
    W = wmul * bs + off
    if W < 1:
        pytest.skip("window < 1")
    m = KVCacheManager(64, bs, enable_prefix_caching=caching, windows=(W,))
    s = mkseq(1, [7], bs)
    start(m, s)
    bound = _cdiv(W, bs) + 1
    steady_max = returned = 0
    for t in range(1, 3 * W + 12 * bs):
        decode(m, s, t % 5)
        m.check_invariants()
        returned += m.free_out_of_window(1)
        m.check_invariants()
        n = s.num_computed_tokens
        assert_trimmed(m, s)
        h = held(m, 1, 0)
        # the blocks covering positions [n - W + 1, n - 1], the keys already written
        assert h == (n - 1) // bs - first_live(W, n, bs) + 1
        assert h <= bound, f"{h} blocks held, the window allows {bound}"
        st_ = m.stats()
        assert st_["kv_sliding_blocks_held_max"] == h
        assert st_["kv_cache_groups"] == 1
        # one sequence, nothing shared: every freed table entry was one block back to the pool
        assert st_["kv_blocks_freed_out_of_window"] == first_live(W, n, bs)
        assert st_["kv_blocks_used"] == h
        if n > W + 2 * bs:
            steady_max = max(steady_max, h)
    assert returned <= m.stats()["kv_blocks_freed_out_of_window"]  # allocate trims too
    if W % bs == 0:
        # W/bs + 1 once a block can straddle the window's start with the last block partial;
        # with blocks of 1 or 2 tokens that never happens
        assert steady_max == {1: W - 1, 2: W // 2}.get(bs, W // bs + 1)
    m.free(1)
    assert_all_returned(m)


def test_a_long_prompt_is_trimmed_by_free_out_of_window_or_the_next_allocate() -> None:
    bs, W = 4, 8
    m = KVCacheManager(32, bs, windows=(W,))
    s = mkseq(1, range(100, 141), bs)  # 41 tokens: 11 blocks
    start(m, s, cache=False)
    assert held(m, 1, 0) == 11, "a start computes the whole chunk: every block is written"
    assert m.stats()["kv_sliding_blocks_held_max"] == 11
    assert m.free_out_of_window(1) == first_live(W, 41, bs) == 8
    assert m.free_out_of_window(1) == 0, "nothing more to free"
    assert_trimmed(m, s)
    assert m.stats()["kv_blocks_freed_out_of_window"] == 8
    # without free_out_of_window, the next allocate trims before growing
    t = mkseq(2, range(200, 241), bs)
    start(m, t, cache=False)
    decode(m, t, 1)
    assert m.block_tables(2)[0][:8] == [m.null_block_id] * 8
    assert m.stats()["kv_blocks_freed_out_of_window"] == 16
    m.check_invariants()
    m.free(1)
    m.free(2)
    assert_all_returned(m)


def test_chunked_prefill_past_the_window_needs_only_the_window() -> None:
    bs, W = 4, 8
    m = KVCacheManager(5, bs, windows=(W,), enable_prefix_caching=False)
    s = mkseq(1, range(100, 200), bs)  # 25 blocks through a pool of 5
    start(m, s, 4)
    while s.num_computed_tokens < 100:
        assert m.allocate_slots(s, 4) is not None, s.num_computed_tokens
        m.free_out_of_window(1)
        assert_trimmed(m, s)
        assert held(m, 1, 0) <= _cdiv(W, bs) + 1
        m.check_invariants()
    assert m.stats()["peak_kv_blocks_used"] <= 4
    m.free(1)
    assert_all_returned(m)


def test_window_one_keeps_only_the_partial_last_block() -> None:
    bs = 4
    m = KVCacheManager(8, bs, windows=(1,))
    s = mkseq(1, [1, 2, 3, 4, 5, 6], bs)
    start(m, s)
    m.free_out_of_window(1)
    [table] = m.block_tables(1)
    assert table[0] == m.null_block_id and table[1] != m.null_block_id
    decode(m, s, 7)
    decode(m, s, 8)  # 8 tokens: the last block is full, the next query sees only itself
    m.free_out_of_window(1)
    assert m.block_tables(1) == [[m.null_block_id] * 2] and m.stats()["kv_blocks_used"] == 0
    decode(m, s, 9)
    assert held(m, 1, 0) == 1
    m.check_invariants()
    m.free(1)
    assert_all_returned(m)


def test_invalid_windows_are_rejected() -> None:
    for windows in [(), (0,), (None, -3)]:
        with pytest.raises(ValueError, match="window"):
            KVCacheManager(4, 4, windows=windows)


# -- 2. hybrid: full groups keep everything, every group needs its blocks ------------------------
@pytest.mark.parametrize("windows", [(8, None, 8), (None, 6), (5, None), (8, None, 3, None)])
def test_hybrid_full_groups_keep_every_block_and_sliding_groups_trim(windows) -> None:
    bs = 4
    m = KVCacheManager(128, bs, windows=windows)
    s = mkseq(1, range(100, 110), bs)
    new = m.allocate_slots(s, 10, m.get_computed_blocks(s))
    assert new is not None and len(new.other_groups) == len(windows) - 1
    assert [new.block_ids, *(b for _, b in new.other_groups)] == m.block_tables(1)
    for t in range(60):
        before = m.block_tables(1)
        s.append_token(t % 7)
        new = m.allocate_slots(s, 1)
        assert new is not None
        after = m.block_tables(1)
        # NewBlocks: each group's table from its first change; freed entries are not reported
        for (gstart, gids), a in zip([(new.start, new.block_ids), *new.other_groups], after,
                                     strict=True):
            assert gids == a[gstart:] and gstart == len(before[0]), "no copy: only appends"
        m.free_out_of_window(1)
        m.check_invariants()
        assert_trimmed(m, s)
        n = s.num_computed_tokens
        tables = m.block_tables(1)
        for g, w in enumerate(windows):
            if w is None:
                assert m.null_block_id not in tables[g] and len(tables[g]) == _cdiv(n, bs)
        live = sum(b != m.null_block_id for t_ in tables for b in t_)
        assert m.stats()["kv_blocks_used"] == live, "no block is shared between groups"
        assert len({b for t_ in tables for b in t_ if b != m.null_block_id}) == live
        assert m.stats()["kv_cache_groups"] == len(windows)
        sliding = [held(m, 1, g) for g, w in enumerate(windows) if w is not None]
        assert m.stats()["kv_sliding_blocks_held_max"] == max(sliding)
    m.free(1)
    assert_all_returned(m)


def test_hybrid_start_needs_blocks_in_every_group_or_changes_nothing() -> None:
    bs, windows = 4, (8, None, 8)
    m = KVCacheManager(11, bs, windows=windows)
    other = mkseq(9, [1], bs)
    start(m, other)  # holds 3 blocks (one per group): 8 free
    s = mkseq(1, range(100, 111), bs)  # 3 blocks per group = 9 > 8
    before = snapshot(m, [other])
    assert m.allocate_slots(s, 11, m.get_computed_blocks(s)) is None
    assert snapshot(m, [other]) == before and s.num_computed_tokens == 0
    with pytest.raises(KeyError):
        m.block_tables(1)
    assert m.allocate_slots(s, 8, m.get_computed_blocks(s)) is not None  # 2 per group fits
    assert m.num_free_blocks() == 2
    m.check_invariants()


def test_hybrid_growth_needs_a_block_in_every_group_or_changes_nothing() -> None:
    bs, windows = 4, (8, None, 8)
    m = KVCacheManager(14, bs, windows=windows)
    s = mkseq(1, range(100, 120), bs)  # 20 tokens: 5 blocks per group
    start(m, s, 12, cache=False)
    assert m.free_out_of_window(1) == 2  # block 0 of both sliding groups
    assert m.allocate_slots(s, 8) is not None
    assert m.free_out_of_window(1) == 4  # blocks 1-2 of both sliding groups
    o = mkseq(2, [5], bs)
    start(m, o)  # 3 more blocks: 2 free, the next token of s needs 3
    assert m.num_free_blocks() == 2
    before = snapshot(m, [s, o])
    s.append_token(1)
    assert m.allocate_slots(s, 1) is None
    assert snapshot(m, [s, o]) == before and m.take_block_copies() == []
    m.check_invariants()
    m.free(2)
    free = m.num_free_blocks()
    assert m.allocate_slots(s, 1) is not None
    assert m.num_free_blocks() == free - 3, "one new block in each of the 3 groups"
    assert_trimmed(m, s)
    m.check_invariants()
    m.free(1)
    assert_all_returned(m)


def test_a_refused_growth_changes_only_what_free_out_of_window_would() -> None:
    """allocate_slots trims before it checks the pool, so a refusal is not quite a no-op: the
    dead blocks are gone (nothing reads them again). Nothing else may change."""

    def setup() -> tuple[KVCacheManager, list[KVSeq]]:
        m = KVCacheManager(16, 4, windows=(8, None, 8))
        s = mkseq(1, range(100, 120), 4)
        start(m, s, 12, cache=False)
        m.free_out_of_window(1)
        assert m.allocate_slots(s, 8) is not None  # 20 tokens: blocks 1-2 dead, still held
        o = mkseq(2, [5], 4)
        start(m, o)
        assert m.num_free_blocks() == 0
        s.extend(range(8))  # 2 more blocks per group: 6 > the 4 that trimming frees
        return m, [s, o]

    m, seqs = setup()
    assert m.allocate_slots(seqs[0], 8) is None
    assert seqs[0].num_computed_tokens == 20
    m.check_invariants()
    m2, seqs2 = setup()
    assert m2.free_out_of_window(1) == 4  # what the refused call did, and all it did
    assert snapshot(m, seqs) == snapshot(m2, seqs2)
    assert m.take_block_copies() == []


def test_growth_trims_first_so_a_full_pool_still_grows() -> None:
    bs, windows = 4, (8, None, 8)
    m = KVCacheManager(15, bs, windows=windows)
    s = mkseq(1, range(100, 120), bs)
    start(m, s, cache=False)
    assert m.num_free_blocks() == 0
    decode(m, s, 1)  # frees 3 + 3 out-of-window blocks, then takes 3
    assert m.num_free_blocks() == 3
    assert m.stats()["kv_blocks_freed_out_of_window"] == 6
    m.check_invariants()
    m.free(1)
    assert_all_returned(m)


# -- 4. fork + copy-on-write, swap ---------------------------------------------------------------
@pytest.mark.parametrize("windows", [(8,), (8, None, 8), (None, 5)])
def test_fork_shares_and_copies_on_write_in_every_group(windows) -> None:
    bs = 4
    m = KVCacheManager(64, bs, windows=windows)
    p = mkseq(1, range(100, 122), bs)  # 22 tokens: the last block is partial
    start(m, p)
    m.free_out_of_window(1)
    parent_tables = m.block_tables(1)
    c = p.child(2)
    m.fork(1, c)
    assert m.block_tables(2) == parent_tables
    for table in parent_tables:
        for b in table:
            if b != m.null_block_id:
                assert m.block_pool.blocks[b].ref_cnt == 2
    assert m.stats()["kv_blocks_saved_by_sharing"] == sum(held(m, 1, g) for g in
                                                          range(len(windows)))
    m.check_invariants()
    decode(m, c, 7)  # writes into the shared partial block: one copy per group
    copies = m.take_block_copies()
    assert m.take_block_copies() == [], "copies are handed over once"
    child_tables = m.block_tables(2)
    last = 21 // bs
    assert copies == [(parent_tables[g][last], child_tables[g][last])
                      for g in range(len(windows))]
    assert m.block_tables(1) == parent_tables, "the parent's tables are untouched"
    for g in range(len(windows)):
        assert child_tables[g][:last] == parent_tables[g][:last]
        # the freed entries stay freed in both
        dead = first_live(windows[g], 22, bs)
        assert child_tables[g][:dead] == [m.null_block_id] * dead
    m.check_invariants()
    decode(m, p, 8)  # the parent's partial block is its own again: no copy
    assert m.take_block_copies() == []
    for t in range(20):
        decode(m, p, t)
        decode(m, c, t + 1)
        m.free_out_of_window(1)
        m.free_out_of_window(2)
        assert m.take_block_copies() == []
        assert_trimmed(m, p)
        assert_trimmed(m, c)
        m.check_invariants()
    m.free(1)
    m.check_invariants()
    m.free(2)
    assert_all_returned(m)


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    bs = 4
    m = KVCacheManager(64, bs, windows=(8, None))
    p = mkseq(1, range(100, 124), bs)
    start(m, p)
    c = p.child(2)
    m.fork(1, c)
    decode(m, c, 1)
    assert m.take_block_copies() == []
    m.check_invariants()
    m.free(2)
    m.free(1)
    assert_all_returned(m)


@pytest.mark.parametrize("windows", [(8,), (8, None, 8), (None, 5)])
@pytest.mark.parametrize("caching", [True, False])
def test_swap_keeps_freed_entries_freed(windows, caching: bool) -> None:
    bs = 4
    m = KVCacheManager(64, bs, windows=windows, num_cpu_blocks=40, enable_prefix_caching=caching)
    s = mkseq(1, range(100, 130), bs)  # 30 tokens, not trimmed yet: swap_out trims first
    start(m, s)
    o = mkseq(2, range(200, 230), bs)
    start(m, o)
    m.free_out_of_window(2)
    c = o.child(3)
    m.fork(2, c)  # swapped together with its parent: shared blocks are copied once
    copies = m.swap_out([1, 2, 3])
    assert copies is not None
    assert m.stats()["kv_blocks_freed_out_of_window"] > 0
    live = [m.seqs[i].blocks for i in (1, 2, 3)]
    distinct = {b.block_id for tables in live for t in tables for b in t if b is not None}
    assert len(copies) == len(distinct) == m.stats()["kv_cpu_blocks_used"]
    assert m.stats()["kv_blocks_used"] == 0 and m.stats()["kv_sliding_blocks_held_max"] == 0
    assert m.free_out_of_window(1) == 0, "nothing to trim while swapped out"
    with pytest.raises(ValueError, match="swapped"):
        m.block_tables(1)
    m.check_invariants()
    back = m.swap_in([1, 2, 3])
    assert back is not None and len(back) <= len(copies)
    for x in (s, o, c):
        assert_trimmed(m, x)
    assert m.block_tables(2) == m.block_tables(3), "the fork still shares after the round trip"
    assert m.stats()["kv_cpu_blocks_used"] == 0
    m.check_invariants()
    for t in range(12):
        for x in (s, o, c):
            decode(m, x, t)
            m.free_out_of_window(x.seq_id)
            assert_trimmed(m, x)
        m.take_block_copies()
        m.check_invariants()
    for i in (1, 2, 3):
        m.free(i)
    assert_all_returned(m)


def test_swap_out_refused_when_the_cpu_pool_is_short() -> None:
    bs, windows = 4, (8, None, 8)
    m = KVCacheManager(64, bs, windows=windows, num_cpu_blocks=9)
    s = mkseq(1, range(100, 130), bs)  # full group 8 blocks + 3 + 3 after trimming
    start(m, s)
    m.free_out_of_window(1)
    before = snapshot(m, [s])
    assert m.swap_out([1]) is None
    assert snapshot(m, [s]) == before
    m.check_invariants()
    m.free(1)
    assert_all_returned(m)
    m2 = KVCacheManager(64, bs, windows=windows, num_cpu_blocks=14)
    s = mkseq(1, range(100, 130), bs)
    start(m2, s)
    assert m2.swap_out([1]) is not None, "8 + 3 + 3 blocks fit once the windows are trimmed"
    m2.free(1)
    assert_all_returned(m2)


def test_shared_block_still_in_a_siblings_window_counts_as_live() -> None:
    bs = 4
    m = KVCacheManager(64, bs, windows=(8,))
    p = mkseq(1, range(100, 122), bs)  # 22 tokens: sees positions 15-21
    start(m, p)
    m.free_out_of_window(1)
    c = p.child(2)
    m.fork(1, c)
    for t in range(4):  # 26 tokens: sees positions 19-25; block 4 (16-19) still shared
        decode(m, c, t)
        m.free_out_of_window(2)
    assert m.block_tables(1)[0][4] == m.block_tables(2)[0][4]
    st_ = m.stats()
    # filled: blocks 3 (12-15), 4 (16-19), 5 (20-21), the child's copy 6 (20-23), 7 (24-25);
    # only 12-14 of block 3 is dead for everyone who holds it
    assert st_["kv_slots_out_of_window"] == 3
    assert st_["kv_slots_live"] == 13
