"""KVCacheManager's allocation and growth, prefix caching (hits, hashing, the extra key, digests
that collide) and the eviction order of cached free blocks, one behaviour per test. Fork,
copy-on-write, running out and swap: test_kv_manager_fork_swap.py."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import pytest

from octavo.paging import EMPTY_PREFIX, BlockHasher, KVCacheManager, KVSeq, NewBlocks, block_hash
from tests.paging.kv_manager_helpers import BS, allocate, fork, grow, make, seq, snapshot


def cached_tokens(m: KVCacheManager, tokens: Iterable[int], extra_key: Hashable = None) -> int:
    """The old find_cached_prefix(tokens, extra_key): leading tokens found in the cache."""
    found = m.get_computed_blocks(seq(-1, tokens, extra_key))
    assert len(found.blocks[0]) * BS == found.num_tokens
    return found.num_tokens


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
