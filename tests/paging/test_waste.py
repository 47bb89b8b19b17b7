"""Waste accounting: the slot shares add up for both allocators, and the tracker averages them."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from octavo.paging import BlockHasher, ContiguousAllocator, KVAllocator, KVCacheManager, KVSeq
from octavo.paging.waste import SLOT_KEYS, Reservation, WasteTracker, contiguous_slot_stats

NUM_BLOCKS, BS = 32, 4
ALLOCATORS = {
    "paged": lambda: KVCacheManager(NUM_BLOCKS, BS),
    "contiguous": lambda: ContiguousAllocator(NUM_BLOCKS, BS, max_model_len=24),
    "contiguous-request": lambda: ContiguousAllocator(
        NUM_BLOCKS, BS, max_model_len=24, reserve="request"
    ),
}


def slot_sum(stats) -> int:
    return sum(stats[key] for key in SLOT_KEYS.values())


@pytest.mark.parametrize("kind", ALLOCATORS)
def test_both_allocators_satisfy_the_sum_invariant(kind: str) -> None:
    alloc = ALLOCATORS[kind]()
    assert isinstance(alloc, KVAllocator)
    rng = random.Random(0)
    seqs: dict[int, KVSeq] = {}
    for step in range(200):
        if seqs and rng.random() < 0.1:
            victim = rng.choice(sorted(seqs))
            alloc.free(victim)
            assert seqs[victim].num_computed_tokens == 0 and not _alive(alloc, victim)
            seqs = {s: q for s, q in seqs.items() if _alive(alloc, s)}
        elif rng.random() < 0.3:
            prompt = [rng.randrange(5) for _ in range(rng.randint(1, 12))]
            budget = len(prompt) + rng.randint(1, 12)
            s = KVSeq(step, prompt, hasher=BlockHasher(BS), reserve_tokens=budget)
            cached = alloc.get_computed_blocks(s)
            before = alloc.stats()
            # the baseline's waste report needs to know where the sequence will end
            final = {"final_tokens": budget} if kind != "paged" else {}
            new = alloc.allocate_slots(s, len(prompt) - cached.num_tokens, cached, **final)
            if new is None:
                assert alloc.stats() == before and not _alive(alloc, step)
            else:
                assert s.num_computed_tokens == len(prompt)
                seqs[step] = s
        elif seqs:
            s = seqs[rng.choice(sorted(seqs))]
            if s.num_new_tokens == 0:  # else the token refused last time is still pending
                s.append_token(rng.randrange(5))
            computed, before = s.num_computed_tokens, alloc.stats()
            if alloc.allocate_slots(s, 1) is None:
                assert s.num_computed_tokens == computed and alloc.stats() == before
            else:
                assert s.num_computed_tokens == computed + 1
        assert slot_sum(alloc.stats()) == NUM_BLOCKS * BS
        alloc.check_invariants()


def _alive(alloc, seq: int) -> bool:
    try:
        alloc.block_table(seq)
    except KeyError:
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.none() | st.integers(0, 60)),
        max_size=5,
    ),
    extents=st.lists(st.integers(1, 10), max_size=5),
    threshold=st.integers(1, 10),
)
def test_contiguous_shares_add_up_for_any_reservations(runs, extents, threshold) -> None:
    reservations = [Reservation(min(f, r), r, final) for f, r, final in runs]
    stats = contiguous_slot_stats(
        block_size=BS,
        reservations=reservations,
        free_extents=extents,
        min_reservation_blocks=threshold,
    )
    assert slot_sum(stats) == sum(r.reserved_slots for r in reservations) + BS * sum(extents)
    assert stats["kv_slots_live"] == sum(r.filled for r in reservations)


def test_waste_tracker_gives_mean_and_peak_shares() -> None:
    tracker = WasteTracker()
    base = dict.fromkeys(SLOT_KEYS.values(), 0)
    tracker.sample({**base, "kv_slots_live": 30, "kv_slots_reserved_waste": 70})
    tracker.sample({**base, "kv_slots_live": 90, "kv_slots_free": 10})
    summary = tracker.summary()
    assert summary["live"] == pytest.approx({"mean": 0.6, "peak": 0.9})
    assert summary["reserved"] == pytest.approx({"mean": 0.35, "peak": 0.7})
    assert summary["external"] == {"mean": 0.0, "peak": 0.0}
    tracker.sample({**base, "kv_slots_live": 0, "kv_slots_free": 100}, weight=2.0)
    assert tracker.summary()["live"]["mean"] == pytest.approx(120 / 100 / 4)
