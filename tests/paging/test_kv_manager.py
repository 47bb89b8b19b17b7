"""KVCacheManager, one behaviour per test."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import pytest

from octavo.paging import (
    EMPTY_PREFIX,
    BlockHasher,
    KVCacheManager,
    KVSeq,
    NewBlocks,
    block_hash,
)

BS = 4


def make(num_blocks: int = 16, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, **kw)


def seq(
    seq_id: int, tokens: Iterable[int], extra_key: Hashable | None = None, *, hashed: bool = True
) -> KVSeq:
    """A sequence as the engine makes one: hashed with the manager's block size (prefix caching
    on), or without a hasher (`hashed=False`: prefix caching off needs no block hashes)."""
    return KVSeq(seq_id, tokens, hasher=BlockHasher(BS) if hashed else None, extra_key=extra_key)


def fork(m: KVCacheManager, parent: KVSeq, child_id: int) -> KVSeq:
    """The child the engine forks: the parent's tokens, block hashes and computed count."""
    child = parent.child(child_id)
    m.fork(parent.seq_id, child)
    return child


def allocate(m: KVCacheManager, s: KVSeq, n: int, *, use_prefix_cache: bool = True) -> int:
    """Start `s` (on its cached prefix unless `use_prefix_cache=False`) and give `n` more tokens
    their slots; returns the cached prefix length. The start must succeed."""
    cached = m.get_computed_blocks(s) if use_prefix_cache else None
    new = m.allocate_slots(s, n, cached)
    assert new is not None, f"could not start sequence {s.seq_id}"
    num_cached = 0 if cached is None else cached.num_tokens
    table = m.block_table(s.seq_id)
    assert new == NewBlocks(0, table), "a start returns the whole block table"
    if cached is not None:
        assert table[: len(cached.blocks[0])] == [b.block_id for b in cached.blocks[0]]
    assert s.num_computed_tokens == num_cached + n
    return num_cached


def grow(m: KVCacheManager, s: KVSeq, n: int) -> NewBlocks:
    """Give the next `n` known tokens of a started sequence their slots; must succeed."""
    before = m.block_table(s.seq_id)
    k = s.num_computed_tokens
    cow = n > 0 and k % BS != 0 and m.block_pool.blocks[before[k // BS]].ref_cnt > 1
    new = m.allocate_slots(s, n)
    assert new is not None, f"could not grow sequence {s.seq_id}"
    after = m.block_table(s.seq_id)
    assert new.start == (k // BS if cow else len(before)), "NewBlocks.start is the first change"
    assert after[: new.start] == before[: new.start] and new.block_ids == after[new.start :]
    assert s.num_computed_tokens == k + n
    return new


def cached_tokens(m: KVCacheManager, tokens: Iterable[int], extra_key: Hashable = None) -> int:
    """The old find_cached_prefix(tokens, extra_key): leading tokens found in the cache."""
    found = m.get_computed_blocks(seq(-1, tokens, extra_key))
    assert len(found.blocks[0]) * BS == found.num_tokens
    return found.num_tokens


def snapshot(m: KVCacheManager, running: Iterable[KVSeq] = (), swapped: Iterable[KVSeq] = ()):
    running, swapped = tuple(running), tuple(swapped)
    return (
        m.stats(),
        {s.seq_id: m.block_table(s.seq_id) for s in running},
        {s.seq_id: s.num_computed_tokens for s in (*running, *swapped)},
        [b.block_id for b in m.block_pool.iter_free_blocks()],
        [b.block_id for b in m.cpu_pool.iter_free_blocks()],
        [(b.ref_cnt, b.num_filled, b.block_hash) for b in m.block_pool.blocks],
    )


# -- allocation and growth ----------------------------------------------------------------------
def test_blocks_grow_one_at_a_time_with_nothing_reserved_ahead() -> None:
    m = make()
    s = seq(1, range(100, 106))
    assert allocate(m, s, 6) == 0
    assert m.block_table(1) == [0, 1] and s.num_computed_tokens == 6
    for n in range(7, 14):
        s.append_token(n)
        grow(m, s, 1)
        assert len(m.block_table(1)) == -(-n // BS)
    st = m.stats()
    assert st["kv_slots_live"] == 13 and st["kv_slots_internal_waste"] == 3
    assert st["kv_slots_reserved_waste"] == st["kv_slots_external_waste"] == 0
    m.check_invariants()


def test_chunked_prefill_is_repeated_allocate_slots() -> None:
    m = make()
    prompt = list(range(100, 111))
    with pytest.raises(ValueError, match="known tokens"):
        m.allocate_slots(seq(2, prompt), 12)  # a start cannot compute unknown tokens either
    s = seq(1, prompt)
    allocate(m, s, 3)
    assert s.num_computed_tokens == 3 and len(m.block_table(1)) == 1
    assert grow(m, s, 5) == NewBlocks(1, m.block_table(1)[1:])
    assert s.num_computed_tokens == 8 and len(m.block_table(1)) == 2
    grow(m, s, 3)
    assert s.num_computed_tokens == 11 and len(m.block_table(1)) == 3
    before = snapshot(m, [s])
    with pytest.raises(ValueError, match="known tokens"):
        m.allocate_slots(s, 1)  # the next token is not known yet
    assert snapshot(m, [s]) == before
    m.check_invariants()


def test_allocate_slots_rejects_an_id_in_use_and_free_ignores_unknown_ids() -> None:
    m = make()
    s = seq(1, [1, 2])
    allocate(m, s, 2)
    before = snapshot(m, [s])
    other = seq(1, [1, 2])
    with pytest.raises(ValueError, match="already"):
        m.allocate_slots(other, 2, m.get_computed_blocks(other))
    with pytest.raises(ValueError, match="already"):
        m.allocate_slots(s, 0, m.get_computed_blocks(s))  # a started seq takes no prefix
    assert other.num_computed_tokens == 0
    m.free(42)
    assert snapshot(m, [s]) == before
    with pytest.raises(KeyError, match="42"):
        m.block_table(42)


# -- prefix caching -----------------------------------------------------------------------------
def test_prefix_hit_reuses_the_cached_blocks() -> None:
    m = make()
    prompt = list(range(100, 110))
    s1 = seq(1, prompt)
    allocate(m, s1, 10)
    first = m.block_table(1)
    m.free(1)
    assert s1.num_computed_tokens == 0, "free resets the computed-token count"
    before = snapshot(m)
    assert cached_tokens(m, prompt) == 8
    assert cached_tokens(m, prompt + [7, 7]) == 8
    assert cached_tokens(m, [*prompt[:5], 0, *prompt[6:]]) == 4
    assert snapshot(m) == before, "get_computed_blocks is a pure query: no refs, no stats"
    assert m.stats()["prefix_cache_query_tokens"] == 10
    s2 = seq(2, prompt)
    cached = m.get_computed_blocks(s2)
    assert [b.block_id for b in cached.blocks[0]] == first[:2]
    assert allocate(m, s2, 2) == 8
    assert m.block_table(2)[:2] == first[:2]
    st = m.stats()
    assert st["prefix_cache_query_tokens"] == 20 and st["prefix_cache_hit_tokens"] == 8
    m.check_invariants()


def test_a_hit_always_leaves_the_last_prompt_token_to_compute() -> None:
    m = make()
    prompt = list(range(100, 108))  # exactly two blocks
    allocate(m, seq(1, prompt), 8)
    assert cached_tokens(m, prompt) == 4
    assert allocate(m, seq(2, prompt), 4) == 4


def test_hits_on_blocks_in_use_are_free_but_hits_on_cached_free_blocks_are_not() -> None:
    m = make(4)
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    allocate(m, seq(1, prompt), 9)
    assert m.num_free_blocks() == 1
    assert allocate(m, seq(5, prompt), 1) == 8, "shares 2 blocks with seq 1, needs 1 fresh"
    assert m.num_free_blocks() == 0
    m.free(5)
    m.free(1)
    s2 = seq(2, [1])
    allocate(m, s2, 1)  # 3 free, 2 of them are the cached prefix
    assert m.num_free_blocks() == 3 and m.stats()["kv_blocks_cached_free"] == 2
    before = snapshot(m, [s2])
    s3 = seq(3, prompt + [0] * 4)
    cached = m.get_computed_blocks(s3)
    assert cached.num_tokens == 8
    assert m.allocate_slots(s3, 5, cached) is None, "2 cached-free + 2 fresh > 3 free"
    assert snapshot(m, [s2]) == before and s3.num_computed_tokens == 0
    with pytest.raises(KeyError):
        m.block_table(3)
    assert allocate(m, seq(4, prompt), 1) == 8, "2 cached-free + 1 fresh fit in 3 free"
    assert m.num_free_blocks() == 0
    m.check_invariants()


def test_generated_tokens_are_cached_too() -> None:
    m = make()
    s = seq(1, [1, 2, 3])
    allocate(m, s, 3)
    for t in (4, 5, 6, 7, 8):
        s.append_token(t)
        grow(m, s, 1)
    m.free(1)
    assert cached_tokens(m, [*s.token_ids, 9]) == 8


def test_extra_key_separates_caches() -> None:
    m = make()
    prompt = list(range(100, 110))
    allocate(m, seq(1, prompt, "lora-a"), 10)
    assert cached_tokens(m, prompt) == 0
    assert cached_tokens(m, prompt, "lora-b") == 0
    assert cached_tokens(m, prompt, "lora-a") == 8


def test_colliding_digest_never_gives_a_wrong_hit(monkeypatch) -> None:
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda *args: b"\0" * 16)
    m = make()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    s1 = seq(1, a)
    assert s1.block_hashes == [b"\0" * 16] * 2, "the colliding digest is in use"
    allocate(m, s1, 9)
    assert cached_tokens(m, [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0, "different first block"
    assert cached_tokens(m, [1, 2, 3, 4, 9, 9, 9, 9, 9]) == 4, "only the matching block"
    assert cached_tokens(m, a, extra_key="other") == 0
    m.free(1)
    assert allocate(m, seq(2, [1, 2, 3, 4, 9, 9, 9, 9, 9]), 5) == 4
    m.check_invariants()


def test_a_block_is_only_hit_under_the_prefix_it_was_computed_with(monkeypatch) -> None:
    # A digest that ignores the parent: [X, Y] and [Z, Y] name their second block alike.
    monkeypatch.setattr(
        block_hash, "hash_block_tokens", lambda p, toks, e=None: bytes(toks[:1]) * 16
    )
    m = make()
    s1 = seq(1, [1, 1, 1, 1, 5, 5, 5, 5, 0])  # X Y
    assert s1.block_hashes == [bytes([1]) * 16, bytes([5]) * 16], "the weak digest is in use"
    allocate(m, s1, 9)
    allocate(m, seq(2, [2, 2, 2, 2, 0]), 5)  # Z
    assert cached_tokens(m, [2, 2, 2, 2, 5, 5, 5, 5, 0]) == 4, "Z hits, Y-after-X must not"


def test_block_hashes_are_computed_once_per_block(monkeypatch) -> None:
    calls = []
    real = block_hash.hash_block_tokens
    monkeypatch.setattr(
        block_hash, "hash_block_tokens", lambda *a: calls.append(tuple(a[1])) or real(*a)
    )
    m = make(64)
    s = seq(1, range(10))
    assert len(calls) == 2, "the prompt's full blocks are hashed as its tokens arrive"
    for _ in range(3):  # e.g. admission attempts over several steps
        m.get_computed_blocks(s)
    assert len(calls) == 2, "queries never hash"
    allocate(m, s, 10)
    assert len(calls) == 2, "allocate_slots uses the sequence's hashes"
    for t in range(100, 190):
        s.append_token(t)
        m.get_computed_blocks(s)
        grow(m, s, 1)
    assert len(calls) == 100 // BS, "one hash per block that fills, none per decode step"
    fork(m, s, 2)
    s.extend(range(200, 210))
    grow(m, s, 10)
    assert len(calls) == 110 // BS, "a fork copies hashes; extend hashes each new block once"
    toks = s.token_ids
    assert calls == [tuple(toks[i * BS : (i + 1) * BS]) for i in range(110 // BS)]
    m.check_invariants()


def test_prefix_caching_off_means_no_hits_and_no_hashing(monkeypatch) -> None:
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda *a: pytest.fail("hashed"))
    m = make(enable_prefix_caching=False)
    prompt = list(range(100, 110))
    allocate(m, seq(1, prompt, hashed=False), 10)  # no hasher: nothing needs block hashes
    m.free(1)
    s2 = seq(2, prompt, hashed=False)
    assert m.get_computed_blocks(s2) == EMPTY_PREFIX and allocate(m, s2, 10) == 0
    st = m.stats()
    assert st["kv_blocks_cached_free"] == 0
    assert st["prefix_cache_query_tokens"] == st["prefix_cache_hit_tokens"] == 0
    m.check_invariants()


def test_computing_everything_skips_the_cache_but_still_registers_blocks() -> None:
    m = make()
    prompt = list(range(100, 110))
    allocate(m, seq(1, prompt), 10)
    assert allocate(m, seq(2, prompt), 10, use_prefix_cache=False) == 0
    assert set(m.block_table(1)).isdisjoint(m.block_table(2)), "nothing was reused"
    st = m.stats()
    assert st["prefix_cache_query_tokens"] == 10 and st["prefix_cache_hit_tokens"] == 0
    allocate(m, seq(3, range(200, 210)), 10, use_prefix_cache=False)
    m.free(3)
    assert cached_tokens(m, range(200, 210)) == 8, "its full blocks were registered"
    m.check_invariants()


def test_prefix_caching_needs_block_hashes() -> None:
    m = make()
    with pytest.raises(ValueError, match=rf"BlockHasher\({BS}\)"):
        m.allocate_slots(seq(1, range(10), hashed=False), 10)


def test_a_sequence_without_block_hashes_is_refused_without_state_behind() -> None:
    m = make()
    s = seq(1, range(10), hashed=False)
    before = snapshot(m)
    with pytest.raises(ValueError):
        m.allocate_slots(s, 10, m.get_computed_blocks(s))
    assert s.num_computed_tokens == 0 and snapshot(m) == before
    with pytest.raises(KeyError):
        m.block_table(1)
    m.check_invariants()


def test_a_hasher_of_another_block_size_is_refused() -> None:
    m = make()
    s = KVSeq(1, range(10), hasher=BlockHasher(2))
    with pytest.raises(ValueError):
        m.allocate_slots(s, 10, m.get_computed_blocks(s))


# -- eviction order -----------------------------------------------------------------------------
def test_a_freed_sequence_is_evicted_tail_first() -> None:
    m = make(4)
    prompt = list(range(100, 113))  # 3 full blocks + 1
    allocate(m, seq(1, prompt), 13)
    m.free(1)
    assert m.stats()["kv_blocks_cached_free"] == 3
    allocate(m, seq(2, [1]), 1)  # the plain block goes first
    assert cached_tokens(m, prompt) == 12
    allocate(m, seq(3, [2]), 1)  # evicts block 3 of seq 1, the last full one
    assert cached_tokens(m, prompt) == 8
    allocate(m, seq(4, [3]), 1)
    assert cached_tokens(m, prompt) == 4


def test_least_recently_used_prefix_is_evicted_first() -> None:
    m = make(4)
    a, b = [1] * 4 + [0], [2] * 4 + [0]
    allocate(m, seq(1, a), 5)
    allocate(m, seq(2, b), 5)
    m.free(1)
    m.free(2)
    assert allocate(m, seq(3, a), 1) == 4  # a hit makes `a` recently used again
    m.free(3)
    allocate(m, seq(4, [9] * 9), 9)  # needs 3 blocks: 2 plain free, then evicts the LRU cached one
    assert cached_tokens(m, a) == 4 and cached_tokens(m, b) == 0


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
