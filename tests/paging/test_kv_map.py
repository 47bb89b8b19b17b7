"""The page map's block states, and the contiguous shadow of the same traffic."""

from __future__ import annotations

from octavo.paging import BlockHasher, ContiguousAllocator, KVCacheManager, KVSeq
from octavo.paging.views.contiguous_shadow import ContiguousShadow
from octavo.paging.views.kv_map import PAGED_STATES, count_states, manager_maps, pool_map

BS = 4


def seq(seq_id: int, tokens: list[int]) -> KVSeq:
    return KVSeq(seq_id, tokens, hasher=BlockHasher(BS))


def run(m: KVCacheManager, s: KVSeq) -> None:
    cached = m.get_computed_blocks(s)
    assert m.allocate_slots(s, len(s.token_ids) - cached.num_tokens, cached) is not None


def test_states_follow_every_kind_of_block():
    m = KVCacheManager(12, BS, num_cpu_blocks=4)
    a = seq(0, list(range(10)))  # 3 blocks: two full, one with 2 of 4 slots
    run(m, a)
    b = a.child(1)
    m.fork(0, b)  # all three shared, ref 2
    device, host = manager_maps(m)
    assert device["states"] == "sss" + "f" * 9
    assert device["shared_ref_cnt"] == [0, 2, 1, 2, 2, 2]
    assert device["partial_filled"] == [2, 2]
    assert host["states"] == "ffff"
    m.free(1)
    m.free(0)  # the two full blocks stay cached, the tail goes back plain
    device, _ = manager_maps(m)
    assert device["states"] == "ccf" + "f" * 9
    assert count_states(device["states"], PAGED_STATES) == {
        "free": 10, "used": 0, "shared": 0, "cached": 2}
    assert device["shared_ref_cnt"] == device["partial_filled"] == []


def test_a_prefix_hit_turns_cached_blocks_used_and_swap_moves_them_to_the_host():
    m = KVCacheManager(8, BS, num_cpu_blocks=4)
    run(m, seq(0, list(range(8))))
    m.free(0)
    s = seq(1, list(range(8)) + [99])
    run(m, s)  # hits both cached blocks, adds a partial one
    device, _ = manager_maps(m)
    assert device["states"][:3] == "uuu"
    assert device["partial_filled"] == [2, 1]
    stats = m.stats()
    assert device["states"].count("u") + device["states"].count("s") == stats["kv_blocks_used"]
    assert m.swap_out([1]) is not None
    device, host = manager_maps(m)
    assert host["states"] == "www" + "f"
    assert host["partial_filled"] == [2, 1]
    assert "u" not in device["states"]
    assert m.held_tables(1) == (True, [[0, 1, 2]])


def test_more_than_255_holders_still_reads_shared():
    m = KVCacheManager(4, BS)
    a = seq(0, [1, 2, 3, 4])
    run(m, a)
    for i in range(1, 300):
        m.fork(0, a.child(i))
    device = pool_map(m.block_pool)
    assert device["states"][0] == "s"
    assert device["shared_ref_cnt"][:2] == [0, 300]


def test_contiguous_layout_marks_reserved_and_external_blocks():
    c = ContiguousAllocator(10, BS, max_model_len=16, reserve="request")
    a, b = KVSeq(0, list(range(5))), KVSeq(1, list(range(3)))
    assert c.allocate_slots(a, 5, reserve_tokens=12) is not None  # blocks 0-2, 2 hold tokens
    assert c.allocate_slots(b, 3, reserve_tokens=8) is not None  # blocks 3-4
    assert c.layout() == "uur" + "ur" + "fffff"
    c.free(0)  # a 3-block hole before b: big enough for the smallest (2-block) reservation
    assert c.layout() == "fff" + "ur" + "fffff"
    d = KVSeq(2, [1])
    assert c.allocate_slots(d, 1, reserve_tokens=8) is not None  # first fit: blocks 0-1
    assert c.layout() == "urx" + "ur" + "fffff"  # block 2 alone is too small for anything


def test_shadow_places_frees_and_counts_what_does_not_fit():
    shadow = ContiguousShadow(6, BS, max_model_len=16, reserve="request")
    a, b, c = KVSeq(0, list(range(6))), KVSeq(1, list(range(2))), KVSeq(2, list(range(2)))
    for s in (a, b, c):
        s.num_computed_tokens = len(s.token_ids)
    shadow.sync([(a, 12), (b, 8), (c, 8)])  # 3 + 2 blocks fit, the third needs 2 more
    snap = shadow.snapshot()
    assert snap["states"] == "uur" + "ur" + "x"  # one block: too small for any reservation
    assert (snap["num_seqs_placed"], snap["num_seqs_not_placed"]) == (2, 1)
    a.token_ids += [7, 7, 7]
    a.num_computed_tokens = 9
    shadow.sync([(a, 12), (c, 8)])  # b left: c takes its place; a grew into its third block
    snap = shadow.snapshot()
    assert snap["states"] == "uuu" + "ur" + "x"
    assert (snap["num_seqs_placed"], snap["num_seqs_not_placed"]) == (2, 0)
    assert snap["slots"]["kv_slots_live"] == 9 + 2
    a.num_computed_tokens = 2  # recomputed from the start after a preemption
    shadow.sync([(a, 12), (c, 8)])
    assert shadow.snapshot()["states"] == "urr" + "ur" + "x"
    shadow.sync([])
    assert shadow.snapshot()["states"] == "ffffff"
    shadow.alloc.check_invariants()


def test_max_model_len_shadow_reserves_the_whole_length():
    shadow = ContiguousShadow(8, BS, max_model_len=16, reserve="max_model_len")
    a, b, c = (KVSeq(i, [1, 2]) for i in range(3))
    for s in (a, b, c):
        s.num_computed_tokens = 2
    shadow.sync([(a, 4), (b, 4), (c, 4)])
    snap = shadow.snapshot()
    assert snap["states"] == "urrr" + "urrr"
    assert snap["num_seqs_not_placed"] == 1
