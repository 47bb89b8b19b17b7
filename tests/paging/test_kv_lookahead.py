"""Lookahead slots (speculative decoding): draft tokens get slots past the known tokens; only
the accepted ones become computed and cached, and blocks the rejected tail took go back."""

from __future__ import annotations

import random

import pytest

from octavo.paging import BlockHasher, ContiguousAllocator, KVCacheManager, KVSeq

BS = 4


def started(m: KVCacheManager, tokens: list[int], seq_id: int = 0) -> KVSeq:
    s = KVSeq(seq_id, tokens, hasher=BlockHasher(BS))
    assert m.allocate_slots(s, len(tokens) - 1, m.get_computed_blocks(s)) is not None
    return s


def test_lookahead_blocks_are_handed_out_but_not_computed_or_cached():
    m = KVCacheManager(16, BS)
    s = started(m, [1, 2, 3, 4, 5, 6])  # 5 computed, token 6 is the decode
    new = m.allocate_slots(s, 1, num_lookahead_tokens=5)  # positions 5 and 6..10
    assert new is not None
    assert s.num_computed_tokens == 6
    assert len(m.block_table(0)) == 3  # slots 0..10
    assert new.start == 2 and len(new.block_ids) == 1
    m.check_invariants()
    # nothing past the known tokens is cached: a sequence with the same known tokens and
    # more hits only the first full block
    assert m.stats()["kv_blocks_used"] == 3


def test_accept_keeps_the_accepted_slots_and_frees_the_rejected_tail_blocks():
    m = KVCacheManager(16, BS)
    s = started(m, [1, 2, 3, 4, 5, 6])
    assert m.allocate_slots(s, 1, num_lookahead_tokens=5) is not None
    free_before = m.num_free_blocks()
    s.extend([7, 8, 9])  # two drafts accepted (7, 8) and the token after them (9)
    m.accept_lookahead(0, 2)
    assert s.num_computed_tokens == 8  # 9 is the next decode
    assert len(m.block_table(0)) == 2  # the third block held only rejected drafts
    assert m.num_free_blocks() == free_before + 1
    m.check_invariants()
    # the second block (5, 6, 7, 8) is full of accepted tokens: it is cached
    other = KVSeq(1, [1, 2, 3, 4, 5, 6, 7, 8, 0], hasher=BlockHasher(BS))
    assert m.get_computed_blocks(other).num_tokens == 8


def test_rejected_drafts_are_never_cached():
    m = KVCacheManager(16, BS)
    s = started(m, [1, 2, 3])  # 2 computed
    assert m.allocate_slots(s, 1, num_lookahead_tokens=4) is not None  # drafts fill block 0, 1
    s.extend([9])  # every draft rejected: the sample after the decode was 9
    m.accept_lookahead(0, 0)
    assert s.num_computed_tokens == 3
    assert len(m.block_table(0)) == 1
    m.check_invariants()
    probe = KVSeq(1, [1, 2, 3, 4, 5, 6, 7, 8, 0], hasher=BlockHasher(BS))  # a draft's tokens
    assert m.get_computed_blocks(probe).num_tokens == 0


def test_lookahead_that_does_not_fit_changes_nothing():
    m = KVCacheManager(2, BS)
    s = started(m, [1, 2, 3, 4, 5])  # 2 blocks, both used
    assert m.allocate_slots(s, 1, num_lookahead_tokens=4) is None
    assert s.num_computed_tokens == 4
    m.check_invariants()
    assert m.allocate_slots(s, 1, num_lookahead_tokens=3) is not None  # fits block 1
    m.check_invariants()


def test_pending_lookahead_must_be_accepted_before_anything_else():
    m = KVCacheManager(16, BS, num_cpu_blocks=8)
    s = started(m, [1, 2, 3])
    assert m.allocate_slots(s, 1, num_lookahead_tokens=2) is not None
    s.extend([4])
    with pytest.raises(ValueError, match="accept_lookahead first"):
        m.allocate_slots(s, 1)
    with pytest.raises(ValueError, match="lookahead"):
        m.swap_out([0])
    with pytest.raises(ValueError, match="lookahead"):
        m.fork(0, s.child(1))
    with pytest.raises(ValueError, match="accepted of 2"):
        m.accept_lookahead(0, 3)
    m.accept_lookahead(0, 0)
    assert m.allocate_slots(s, 1) is not None
    m.check_invariants()


def test_lookahead_needs_a_started_sequence_and_free_forgets_it():
    m = KVCacheManager(16, BS)
    s = KVSeq(0, [1, 2, 3], hasher=BlockHasher(BS))
    with pytest.raises(ValueError, match="lookahead slots need KV blocks"):
        m.allocate_slots(s, 3, num_lookahead_tokens=1)
    s = started(m, [1, 2, 3])
    assert m.allocate_slots(s, 1, num_lookahead_tokens=6) is not None
    m.free(0)  # e.g. the verified tokens finished it
    m.accept_lookahead(0, 2)  # a freed sequence is ignored
    assert m.num_free_blocks() == 16
    m.check_invariants()


def test_copy_on_write_then_lookahead_on_a_forked_sequence():
    m = KVCacheManager(16, BS)
    s = started(m, [1, 2, 3, 4, 5, 6])
    child = s.child(1)
    m.fork(0, child)
    new = m.allocate_slots(child, 1, num_lookahead_tokens=3)  # shared block 1 is copied first
    assert new is not None and new.start == 1
    assert len(m.take_block_copies()) == 1
    child.extend([7, 8])
    m.accept_lookahead(1, 1)
    m.check_invariants()
    assert m.block_table(0)[0] == m.block_table(1)[0]


@pytest.mark.parametrize("seed", range(8))
def test_random_speculative_steps_keep_the_invariants(seed):
    """Many sequences decoding with random drafts and random acceptance, some freed, in a
    small pool: after every step the invariants hold; at the end every block is free."""
    rng = random.Random(seed)
    m = KVCacheManager(24, BS, enable_prefix_caching=True)
    seqs: dict[int, KVSeq] = {}
    for i in range(4):
        seqs[i] = started(m, [rng.randrange(5) for _ in range(rng.randint(2, 9))], i)
    for _ in range(200):
        if not seqs:
            break
        sid = rng.choice(list(seqs))
        s = seqs[sid]
        k = rng.randint(0, 6)
        new = m.allocate_slots(s, 1, num_lookahead_tokens=k)
        if new is None:
            m.free(sid)
            del seqs[sid]
        else:
            accepted = rng.randint(0, k)
            s.extend(rng.randrange(5) for _ in range(accepted + 1))
            if k:
                m.accept_lookahead(sid, accepted)
            if rng.random() < 0.05:
                m.free(sid)
                del seqs[sid]
        m.check_invariants()
    for sid in list(seqs):
        m.free(sid)
    m.check_invariants()
    assert m.num_free_blocks() == 24


def test_contiguous_lookahead_stays_inside_the_reservation():
    m = ContiguousAllocator(8, BS, max_model_len=8)
    s = KVSeq(0, [1, 2, 3])
    assert m.allocate_slots(s, 2) is not None  # reserves 8 slots
    assert m.allocate_slots(s, 1, num_lookahead_tokens=6) is None  # 9 slots
    assert m.allocate_slots(s, 1, num_lookahead_tokens=5) is not None
    s.extend([4, 5])
    m.accept_lookahead(0, 1)
    assert s.num_computed_tokens == 4
    m.check_invariants()
