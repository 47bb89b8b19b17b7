"""KVCacheManager, one behaviour per test."""

from __future__ import annotations

import pytest

from octavo.paging import KVCacheManager, OutOfKVBlocks, kv_manager

BS = 4


def make(num_blocks: int = 16, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, **kw)


def snapshot(m: KVCacheManager, running=(), swapped=()) -> tuple:
    return (
        m.stats(),
        {s: m.block_table(s) for s in running},
        {s: m.num_computed_tokens(s) for s in (*running, *swapped)},
        [b.block_id for b in m.block_pool.iter_free_blocks()],
        [b.block_id for b in m.cpu_pool.iter_free_blocks()],
    )


# -- allocation and growth ----------------------------------------------------------------------
def test_blocks_grow_one_at_a_time_with_nothing_reserved_ahead() -> None:
    m = make()
    tokens = list(range(100, 106))
    assert m.allocate(1, tokens, 6) == 0
    assert m.block_table(1) == [0, 1] and m.num_computed_tokens(1) == 6
    for n in range(7, 14):
        tokens.append(n)
        m.append_slots(1, tokens, 1)
        assert len(m.block_table(1)) == -(-n // BS)
    s = m.stats()
    assert s["kv_slots_live"] == 13 and s["kv_slots_internal_waste"] == 3
    assert s["kv_slots_reserved_waste"] == s["kv_slots_external_waste"] == 0
    m.check_invariants()


def test_chunked_prefill_is_allocate_then_append_slots() -> None:
    m = make()
    prompt = list(range(100, 111))
    m.allocate(1, prompt, 3)
    assert m.num_computed_tokens(1) == 3 and len(m.block_table(1)) == 1
    m.append_slots(1, prompt, 5)
    assert m.num_computed_tokens(1) == 8 and len(m.block_table(1)) == 2
    m.append_slots(1, prompt, 3)
    assert m.num_computed_tokens(1) == 11 and len(m.block_table(1)) == 3
    with pytest.raises(ValueError, match="known tokens"):
        m.append_slots(1, prompt, 1)  # the next token is not known yet
    m.check_invariants()


def test_allocate_rejects_an_id_in_use_and_free_ignores_unknown_ids() -> None:
    m = make()
    m.allocate(1, [1, 2], 2)
    with pytest.raises(ValueError, match="already"):
        m.allocate(1, [1, 2], 2)
    m.free(42)
    with pytest.raises(KeyError, match="42"):
        m.block_table(42)


# -- prefix caching -----------------------------------------------------------------------------
def test_prefix_hit_reuses_the_cached_blocks() -> None:
    m = make()
    prompt = list(range(100, 110))
    m.allocate(1, prompt, 10)
    first = m.block_table(1)
    m.free(1)
    assert m.find_cached_prefix(prompt) == 8
    assert m.find_cached_prefix(prompt + [7, 7]) == 8
    assert m.find_cached_prefix([*prompt[:5], 0, *prompt[6:]]) == 4
    assert m.stats()["prefix_cache_query_tokens"] == 10, "find_cached_prefix is a pure query"
    assert m.allocate(2, prompt, 2) == 8
    assert m.block_table(2)[:2] == first[:2]
    s = m.stats()
    assert s["prefix_cache_query_tokens"] == 20 and s["prefix_cache_hit_tokens"] == 8
    m.check_invariants()


def test_a_hit_always_leaves_the_last_prompt_token_to_compute() -> None:
    m = make()
    prompt = list(range(100, 108))  # exactly two blocks
    m.allocate(1, prompt, 8)
    assert m.find_cached_prefix(prompt) == 4
    assert m.allocate(2, prompt, 4) == 4


def test_hits_on_blocks_in_use_are_free_but_hits_on_cached_free_blocks_are_not() -> None:
    m = make(4)
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    m.allocate(1, prompt, 9)
    assert m.num_free_blocks() == 1
    assert m.can_allocate(prompt, 1), "shares 2 blocks with seq 1, needs 1 fresh"
    m.free(1)
    m.allocate(2, [1], 1)  # 3 free, 2 of them are the cached prefix
    assert not m.can_allocate(prompt + [0] * 4, 5), "2 cached-free + 2 fresh > 3 free"
    assert m.can_allocate(prompt, 1)
    with pytest.raises(OutOfKVBlocks):
        m.allocate(3, prompt + [0] * 4, 5)


def test_generated_tokens_are_cached_too() -> None:
    m = make()
    tokens = [1, 2, 3]
    m.allocate(1, tokens, 3)
    for t in (4, 5, 6, 7, 8):
        tokens.append(t)
        m.append_slots(1, tokens, 1)
    m.free(1)
    assert m.find_cached_prefix([*tokens, 9]) == 8


def test_extra_key_separates_caches() -> None:
    m = make()
    prompt = list(range(100, 110))
    m.allocate(1, prompt, 10, extra_key="lora-a")
    assert m.find_cached_prefix(prompt) == 0
    assert m.find_cached_prefix(prompt, "lora-b") == 0
    assert m.find_cached_prefix(prompt, "lora-a") == 8


def test_colliding_digest_never_gives_a_wrong_hit(monkeypatch) -> None:
    monkeypatch.setattr(kv_manager, "hash_block_tokens", lambda *args: b"\0" * 16)
    m = make()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    m.allocate(1, a, 9)
    assert m.find_cached_prefix([9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0, "different first block"
    assert m.find_cached_prefix([1, 2, 3, 4, 9, 9, 9, 9, 9]) == 4, "only the matching block"
    assert m.find_cached_prefix(a, extra_key="other") == 0
    m.free(1)
    m.allocate(2, [1, 2, 3, 4, 9, 9, 9, 9, 9], 5)
    m.check_invariants()


def test_a_block_is_only_hit_under_the_prefix_it_was_computed_with(monkeypatch) -> None:
    # A digest that ignores the parent: [X, Y] and [Z, Y] name their second block alike.
    monkeypatch.setattr(
        kv_manager, "hash_block_tokens", lambda p, toks, e=None: bytes(toks[:1]) * 16
    )
    m = make()
    m.allocate(1, [1, 1, 1, 1, 5, 5, 5, 5, 0], 9)  # X Y
    m.allocate(2, [2, 2, 2, 2, 0], 5)  # Z
    assert m.find_cached_prefix([2, 2, 2, 2, 5, 5, 5, 5, 0]) == 4, "Z hits, Y-after-X must not"


def test_block_hashes_are_computed_once_per_block(monkeypatch) -> None:
    calls = []
    real = kv_manager.hash_block_tokens
    monkeypatch.setattr(kv_manager, "hash_block_tokens", lambda *a: calls.append(a) or real(*a))
    m = make(64)
    tokens = list(range(10))
    m.allocate(1, tokens, 10)
    assert len(calls) == 2
    for t in range(100, 190):
        tokens.append(t)
        m.append_slots(1, tokens, 1)
    assert len(calls) == 100 // BS, "one hash per block that fills, none per decode step"


def test_prefix_caching_off_means_no_hits_and_no_hashing(monkeypatch) -> None:
    monkeypatch.setattr(kv_manager, "hash_block_tokens", lambda *a: pytest.fail("hashed"))
    m = make(enable_prefix_caching=False)
    prompt = list(range(100, 110))
    m.allocate(1, prompt, 10)
    m.free(1)
    assert m.find_cached_prefix(prompt) == 0 and m.allocate(2, prompt, 10) == 0
    assert m.stats()["kv_blocks_cached_free"] == 0
    m.check_invariants()


# -- eviction order -----------------------------------------------------------------------------
def test_a_freed_sequence_is_evicted_tail_first() -> None:
    m = make(4)
    prompt = list(range(100, 113))  # 3 full blocks + 1
    m.allocate(1, prompt, 13)
    m.free(1)
    assert m.stats()["kv_blocks_cached_free"] == 3
    m.allocate(2, [1], 1)  # the plain block goes first
    assert m.find_cached_prefix(prompt) == 12
    m.allocate(3, [2], 1)  # evicts block 3 of seq 1, the last full one
    assert m.find_cached_prefix(prompt) == 8
    m.allocate(4, [3], 1)
    assert m.find_cached_prefix(prompt) == 4


def test_least_recently_used_prefix_is_evicted_first() -> None:
    m = make(4)
    a, b = [1] * 4 + [0], [2] * 4 + [0]
    m.allocate(1, a, 5)
    m.allocate(2, b, 5)
    m.free(1)
    m.free(2)
    m.allocate(3, a, 1)  # a hit makes `a` recently used again
    m.free(3)
    m.allocate(4, [9] * 9, 9)  # needs 3 blocks: 2 plain free, then evicts the LRU cached one
    assert m.find_cached_prefix(a) == 4 and m.find_cached_prefix(b) == 0


# -- fork and copy-on-write ---------------------------------------------------------------------
def test_fork_shares_every_block() -> None:
    m = make()
    tokens = list(range(10))
    m.allocate(1, tokens, 10)
    m.fork(1, 2)
    assert m.block_table(2) == m.block_table(1) and m.num_computed_tokens(2) == 10
    assert all(m.block_pool.blocks[b].ref_cnt == 2 for b in m.block_table(1))
    assert m.stats()["kv_blocks_saved_by_sharing"] == 3
    m.check_invariants()


def test_writing_into_a_shared_block_copies_it_exactly_once() -> None:
    m = make()
    tokens = list(range(10))
    m.allocate(1, tokens, 10)
    parent_table = m.block_table(1)
    m.fork(1, 2)
    m.append_slots(2, [*tokens, 7], 1)
    copies = m.take_block_copies()
    child_table = m.block_table(2)
    assert copies == [(parent_table[2], child_table[2])]
    assert child_table[:2] == parent_table[:2] and child_table[2] != parent_table[2]
    m.append_slots(1, [*tokens, 8], 1)  # the parent's block is no longer shared
    assert m.take_block_copies() == [] and m.block_table(1) == parent_table
    assert m.take_block_copies() == [], "copies are handed over once"
    m.check_invariants()


def test_no_copy_when_the_shared_blocks_are_full() -> None:
    m = make()
    tokens = list(range(8))
    m.allocate(1, tokens, 8)
    m.fork(1, 2)
    m.append_slots(2, [*tokens, 1], 1)
    m.append_slots(1, [*tokens, 2], 1)
    assert m.take_block_copies() == []
    assert m.block_table(1)[:2] == m.block_table(2)[:2]


# -- running out --------------------------------------------------------------------------------
def test_out_of_blocks_leaves_no_state_behind() -> None:
    m = make(3, num_cpu_blocks=1)
    tokens = list(range(10))
    m.allocate(1, tokens, 10)
    m.fork(1, 2)
    before = snapshot(m, running=(1, 2))
    assert not m.can_allocate(list(range(50, 60)), 10)
    with pytest.raises(OutOfKVBlocks, match="need 3 free KV blocks, have 0"):
        m.allocate(3, list(range(50, 60)), 10)
    assert not m.can_append_slots(2, 1), "copy-on-write needs a fresh block"
    with pytest.raises(OutOfKVBlocks):
        m.append_slots(2, [*tokens, 1], 1)
    assert not m.can_swap_out([1])
    with pytest.raises(OutOfKVBlocks):
        m.swap_out([1])
    assert snapshot(m, running=(1, 2)) == before
    assert m.take_block_copies() == [], "a failed append recorded no copy"
    m.check_invariants()


# -- swap ---------------------------------------------------------------------------------------
def test_swap_round_trip_keeps_tables_and_sharing() -> None:
    m = make(8, num_cpu_blocks=8, enable_prefix_caching=False)
    tokens = list(range(10))
    m.allocate(1, tokens, 10)
    m.fork(1, 2)
    m.append_slots(2, [*tokens, 5], 1)
    m.take_block_copies()
    before = {s: m.block_table(s) for s in (1, 2)}
    out = m.swap_out([1, 2])
    assert len(out) == 4, "3 blocks of seq 1 + the child's own last block; shared ones once"
    gpu_to_cpu = dict(out)
    s = m.stats()
    assert s["kv_blocks_used"] == 0 and s["kv_cpu_blocks_used"] == 4
    with pytest.raises(ValueError, match="swapped out"):
        m.block_table(1)
    with pytest.raises(ValueError, match="swapped out"):
        m.append_slots(1, [*tokens, 1], 1)
    m.check_invariants()
    # Occupy the blocks the group had, so swap-in has to land elsewhere.
    m.allocate(3, list(range(50, 62)), 12)
    back = m.swap_in([1, 2])
    cpu_to_gpu = dict(back)
    assert len(back) == 4 and m.stats()["kv_cpu_blocks_used"] == 0
    for seq, table in before.items():
        assert m.block_table(seq) == [cpu_to_gpu[gpu_to_cpu[b]] for b in table]
    assert m.num_computed_tokens(1) == 10 and m.num_computed_tokens(2) == 11
    assert m.block_table(1)[:2] == m.block_table(2)[:2], "shared blocks stay shared"
    m.check_invariants()


def test_swap_in_reuses_blocks_that_are_still_prefix_cached() -> None:
    m = make(8, num_cpu_blocks=4)
    tokens = list(range(10))
    m.allocate(1, tokens, 10)
    table = m.block_table(1)
    assert len(m.swap_out([1])) == 3
    back = m.swap_in([1])
    assert len(back) == 1 and back[0][1] == m.block_table(1)[2], "only the partial block"
    assert m.block_table(1)[:2] == table[:2], "full blocks still cached on the GPU came back"
    m.check_invariants()


def test_freeing_a_swapped_sequence_frees_its_cpu_blocks() -> None:
    m = make(8, num_cpu_blocks=4)
    m.allocate(1, list(range(6)), 6)
    m.swap_out([1])
    assert m.stats()["kv_cpu_blocks_used"] == 2
    m.free(1)
    assert m.stats()["kv_cpu_blocks_used"] == 0
    assert m.num_free_blocks() == 8
    m.check_invariants()


def test_swap_group_must_be_in_the_right_state() -> None:
    m = make(8, num_cpu_blocks=4)
    m.allocate(1, [1, 2], 2)
    with pytest.raises(ValueError, match="not swapped out"):
        m.swap_in([1])
    with pytest.raises(ValueError, match="duplicate"):
        m.swap_out([1, 1])


def test_check_invariants_catches_a_wrong_ref_count() -> None:
    m = make()
    m.allocate(1, list(range(6)), 6)
    m.block_pool.blocks[m.block_table(1)[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref count 2 but held by 1"):
        m.check_invariants()
