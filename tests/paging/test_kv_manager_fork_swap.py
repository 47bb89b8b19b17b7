"""KVCacheManager when sequences share and move blocks: fork and copy-on-write, running out
of blocks with no state left behind, swap out to CPU blocks and back in, and the ref-count
check of check_invariants, one behaviour per test. Allocation, prefix caching and eviction:
test_kv_manager.py."""

from __future__ import annotations

import pytest

from octavo.paging import KVSeq, NewBlocks
from tests.paging.kv_manager_helpers import BS, allocate, fork, grow, make, seq, snapshot


# -- fork and copy-on-write ---------------------------------------------------------------------
def test_fork_shares_every_block() -> None:
    m = make()
    s1 = seq(1, range(10))
    allocate(m, s1, 10)
    s2 = fork(m, s1, 2)
    assert m.block_table(2) == m.block_table(1) and s2.num_computed_tokens == 10
    assert all(m.block_pool.blocks[b].ref_cnt == 2 for b in m.block_table(1))
    assert m.stats()["kv_blocks_saved_by_sharing"] == 3
    m.check_invariants()


def test_fork_checks_the_child() -> None:
    m = make()
    s1 = seq(1, range(10))
    allocate(m, s1, 10)
    s2 = fork(m, s1, 2)
    before = snapshot(m, [s1, s2])
    with pytest.raises(ValueError, match="computed"):
        m.fork(1, KVSeq(3, s1.token_ids, hasher=s1.hasher, num_computed_tokens=9))
    with pytest.raises(ValueError, match="already"):
        m.fork(1, KVSeq(2, s1.token_ids, hasher=s1.hasher, num_computed_tokens=10))
    assert snapshot(m, [s1, s2]) == before
    with pytest.raises(KeyError):
        m.block_table(3)


def test_writing_into_a_shared_block_copies_it_exactly_once() -> None:
    m = make()
    s1 = seq(1, range(10))
    allocate(m, s1, 10)
    parent_table = m.block_table(1)
    s2 = fork(m, s1, 2)
    s2.append_token(7)
    new = grow(m, s2, 1)
    copies = m.take_block_copies()
    child_table = m.block_table(2)
    assert new == NewBlocks(2, [child_table[2]]), "the table changed from the copy's place on"
    assert copies == [(parent_table[2], child_table[2])]
    assert child_table[:2] == parent_table[:2] and child_table[2] != parent_table[2]
    s1.append_token(8)
    assert grow(m, s1, 1) == NewBlocks(3, []), "the parent's block is no longer shared"
    assert m.take_block_copies() == [] and m.block_table(1) == parent_table
    assert m.take_block_copies() == [], "copies are handed over once"
    m.check_invariants()


def test_no_copy_when_the_shared_blocks_are_full() -> None:
    m = make()
    s1 = seq(1, range(8))
    allocate(m, s1, 8)
    s2 = fork(m, s1, 2)
    s2.append_token(1)
    grow(m, s2, 1)
    s1.append_token(2)
    grow(m, s1, 1)
    assert m.take_block_copies() == []
    assert m.block_table(1)[:2] == m.block_table(2)[:2]


# -- running out --------------------------------------------------------------------------------
def test_out_of_blocks_leaves_no_state_behind() -> None:
    m = make(3, num_cpu_blocks=1)
    s1 = seq(1, range(10))
    allocate(m, s1, 10)
    s2 = fork(m, s1, 2)
    running = (s1, s2)
    before = snapshot(m, running)
    assert m.num_free_blocks() == 0
    s3 = seq(3, range(50, 60))
    assert m.allocate_slots(s3, 10, m.get_computed_blocks(s3)) is None, "needs 3 blocks, 0 free"
    assert s3.num_computed_tokens == 0
    with pytest.raises(KeyError):
        m.block_table(3)
    s2.append_token(1)
    assert len(m.block_table(2)) == -(-11 // BS), "no growth: all it needs is the copy"
    assert m.allocate_slots(s2, 1) is None, "copy-on-write needs a fresh block"
    assert m.swap_out([1]) is None, "3 blocks to move, 1 free CPU block"
    assert snapshot(m, running) == before
    assert m.take_block_copies() == [], "a failed append recorded no copy"
    m.check_invariants()
    # The refusal was exact: once 3 blocks are free, the same start fits.
    m.free(1)
    m.free(2)
    assert m.num_free_blocks() == 3
    assert allocate(m, s3, 10) == 0
    m.check_invariants()


# -- swap ---------------------------------------------------------------------------------------
def test_swap_round_trip_keeps_tables_and_sharing() -> None:
    m = make(8, num_cpu_blocks=8, enable_prefix_caching=False)
    s1 = seq(1, range(10), hashed=False)
    allocate(m, s1, 10)
    s2 = fork(m, s1, 2)
    s2.append_token(5)
    grow(m, s2, 1)
    m.take_block_copies()
    before = {s: m.block_table(s) for s in (1, 2)}
    out = m.swap_out([1, 2])
    assert out is not None
    assert len(out) == 4, "3 blocks of seq 1 + the child's own last block; shared ones once"
    gpu_to_cpu = dict(out)
    st = m.stats()
    assert st["kv_blocks_used"] == 0 and st["kv_cpu_blocks_used"] == 4
    with pytest.raises(ValueError, match="swapped out"):
        m.block_table(1)
    s1.append_token(1)
    with pytest.raises(ValueError, match="swapped out"):
        m.allocate_slots(s1, 1)
    assert s1.num_computed_tokens == 10
    m.check_invariants()
    # Occupy the blocks the group had, so swap-in has to land elsewhere.
    allocate(m, seq(3, range(50, 62), hashed=False), 12)
    back = m.swap_in([1, 2])
    assert back is not None
    cpu_to_gpu = dict(back)
    assert len(back) == 4 and m.stats()["kv_cpu_blocks_used"] == 0
    for s, table in before.items():
        assert m.block_table(s) == [cpu_to_gpu[gpu_to_cpu[b]] for b in table]
    assert s1.num_computed_tokens == 10 and s2.num_computed_tokens == 11
    assert m.block_table(1)[:2] == m.block_table(2)[:2], "shared blocks stay shared"
    m.check_invariants()


def test_swap_in_reuses_blocks_that_are_still_prefix_cached() -> None:
    m = make(8, num_cpu_blocks=4)
    allocate(m, seq(1, range(10)), 10)
    table = m.block_table(1)
    out = m.swap_out([1])
    assert out is not None and len(out) == 3
    back = m.swap_in([1])
    assert back is not None
    assert len(back) == 1 and back[0][1] == m.block_table(1)[2], "only the partial block"
    assert m.block_table(1)[:2] == table[:2], "full blocks still cached on the GPU came back"
    m.check_invariants()


def test_freeing_a_swapped_sequence_frees_its_cpu_blocks() -> None:
    m = make(8, num_cpu_blocks=4)
    s = seq(1, range(6))
    allocate(m, s, 6)
    assert m.swap_out([1]) is not None
    assert m.stats()["kv_cpu_blocks_used"] == 2
    m.free(1)
    assert m.stats()["kv_cpu_blocks_used"] == 0 and s.num_computed_tokens == 0
    assert m.num_free_blocks() == 8
    m.check_invariants()


def test_swap_group_must_be_in_the_right_state() -> None:
    m = make(8, num_cpu_blocks=4)
    allocate(m, seq(1, [1, 2]), 2)
    with pytest.raises(ValueError, match="not swapped out"):
        m.swap_in([1])
    with pytest.raises(ValueError, match="duplicate"):
        m.swap_out([1, 1])


def test_check_invariants_catches_a_wrong_ref_count() -> None:
    m = make()
    allocate(m, seq(1, range(6)), 6)
    m.block_pool.blocks[m.block_table(1)[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref count 2 but held by 1"):
        m.check_invariants()
