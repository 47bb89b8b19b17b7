"""The state-slot pool through the KV manager, case by case: snapshots at block boundaries found
by a later prompt once the step ran, copy-on-write after a fork, refusals and eviction when the
pool is full, swap, a failed step, and no speculative lookahead."""

from __future__ import annotations

import pytest

from octavo.paging import BlockHasher, KVCacheManager, KVSeq

BS = 4


def seq(seq_id: int, tokens: list[int]) -> KVSeq:
    return KVSeq(seq_id, tokens, hasher=BlockHasher(BS))


def manager(slots: int = 4, host_slots: int = 2, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(32, BS, enable_prefix_caching=caching, num_cpu_blocks=32,
                          num_state_slots=slots, num_cpu_state_slots=host_slots)


def start(kv: KVCacheManager, s: KVSeq, n: int | None = None):
    cached = kv.get_computed_blocks(s)
    return kv.allocate_slots(s, len(s.token_ids) - cached.num_tokens if n is None else n, cached)


PROMPT = list(range(10, 24))  # 14 tokens: boundaries at 4, 8, 12


def test_snapshot_at_the_last_boundary_is_found_after_the_step() -> None:
    kv = manager()
    a = seq(1, PROMPT)
    new = start(kv, a)
    slot_a = kv.block_tables(1)[-1][0]
    assert new is not None and new.other_groups == ((0, [slot_a]),)
    transfers, snapshots = kv.take_state_ops()
    assert transfers == [] and len(snapshots) == 1
    assert snapshots[0][:2] == (1, 12)  # the last boundary before the last token
    snap = snapshots[0][2]
    b = seq(2, PROMPT[:12] + [99, 98])
    assert kv.get_computed_blocks(b).num_tokens == 0, "found before the step ran"
    kv.commit_step(1)
    cached = kv.get_computed_blocks(b)
    assert cached.num_tokens == 12 and cached.state.block_id == snap
    kv.allocate_slots(b, 2, cached)
    slot_b = kv.block_tables(2)[-1][0]
    assert kv.take_state_ops() == ([("copy", snap, slot_b)], [])
    stats = kv.stats()
    assert stats["state_snapshot_hits"] == 1 and stats["state_snapshots_saved"] == 1
    assert stats["state_slots_used"] == 2 and stats["state_snapshots_cached"] == 1
    assert stats["prefix_cache_hit_tokens"] == 12
    kv.check_invariants()
    # a prefix of the prompt that ends before the snapshot finds nothing to resume from
    c = seq(3, PROMPT[:9] + [1, 1])
    assert kv.get_computed_blocks(c).num_tokens == 0
    kv.free(1), kv.free(2)
    assert kv.stats()["state_slots_used"] == 0
    kv.check_invariants()


def test_decodes_take_no_snapshots_and_caching_off_none_at_all() -> None:
    kv = manager()
    a = seq(1, PROMPT[:4])
    start(kv, a)  # [0, 4): no boundary strictly inside
    a.append_token(5)
    kv.allocate_slots(a, 1)
    assert kv.take_state_ops() == ([], [])
    off = manager(caching=False)
    start(off, seq(1, PROMPT))
    assert off.take_state_ops() == ([], [])


def test_fork_shares_the_slot_until_a_write_copies_it() -> None:
    kv = manager()
    parent = seq(1, PROMPT[:6])
    start(kv, parent)
    kv.take_state_ops()
    kv.commit_step(1)
    child = parent.child(2)
    kv.fork(1, child)
    shared = kv.block_tables(1)[-1][0]
    assert kv.block_tables(2)[-1][0] == shared
    assert kv.stats()["state_slots_used"] == 1
    for s in (parent, child):
        s.append_token(7)
    new = kv.allocate_slots(child, 1)
    copied = kv.block_tables(2)[-1][0]
    assert copied != shared and new.other_groups[-1] == (0, [copied])
    assert kv.take_state_ops() == ([("copy", shared, copied)], [])
    new = kv.allocate_slots(parent, 1)  # the slot is its own again: no copy
    assert new.other_groups[-1] == (1, []) and kv.take_state_ops() == ([], [])
    kv.check_invariants()


def test_no_free_slot_refuses_and_snapshots_are_evicted_first() -> None:
    kv = manager(slots=2)
    start(kv, seq(1, PROMPT))  # its slot and a snapshot
    kv.commit_step(1)
    kv.take_state_ops()
    assert kv.stats()["state_snapshots_cached"] == 1
    start(kv, seq(2, [1, 2, 3]))  # takes the snapshot's slot: evicted
    stats = kv.stats()
    assert stats["state_snapshots_evicted"] == 1 and stats["state_snapshots_cached"] == 0
    before = kv.stats()
    assert start(kv, seq(3, [4, 5, 6])) is None, "a third sequence with two slots"
    assert kv.stats() == before and kv.take_state_ops() == ([], [])
    kv.free(2)
    assert start(kv, seq(3, [4, 5, 6])) is not None
    kv.check_invariants()


def test_swap_moves_the_slot_and_refuses_without_room() -> None:
    kv = manager(slots=4, host_slots=1)
    a, b = seq(1, [1, 2, 3]), seq(2, [4, 5, 6])
    start(kv, a), start(kv, b)
    slot_a = kv.block_tables(1)[-1][0]
    kv.take_state_ops()
    assert kv.swap_out([1, 2]) is None, "two slots, one host slot"
    assert kv.stats()["state_cpu_slots_used"] == 0 and kv.take_state_ops() == ([], [])
    assert kv.swap_out([1]) is not None
    (kind, src, host), = kv.take_state_ops()[0]
    assert (kind, src) == ("out", slot_a) and kv.stats()["state_cpu_slots_used"] == 1
    assert kv.swap_in([1]) is not None
    (kind, src, dst), = kv.take_state_ops()[0]
    assert (kind, src, dst) == ("in", host, kv.block_tables(1)[-1][0])
    assert kv.stats()["state_cpu_slots_used"] == 0
    kv.check_invariants()


def test_a_failed_step_drops_its_snapshots() -> None:
    kv = manager()
    start(kv, seq(1, PROMPT))
    kv.take_state_ops()
    kv.uncache_from(1, 0)
    kv.free(1)
    kv.commit_step(1)  # gone: nothing to commit
    assert kv.stats()["state_slots_used"] == 0 and kv.stats()["state_snapshots_cached"] == 0
    assert kv.get_computed_blocks(seq(2, PROMPT)).num_tokens == 0
    kv.check_invariants()


def test_no_lookahead_for_recurrent_state() -> None:
    kv = manager()
    a = seq(1, [1, 2, 3])
    start(kv, a)
    a.append_token(4)
    with pytest.raises(ValueError, match="does not speculate"):
        kv.allocate_slots(a, 1, num_lookahead_tokens=2)
