"""The KV tier without a model: block records refuse every kind of damage, the disk store is
atomic, bounded and shared safely between processes (a reader racing two writers only ever
sees whole records), and the KV manager's side (saves when blocks are let go, loads for a
prefix the pool misses, loads cancelled or forgotten when a sequence or a step does not
happen) keeps its invariants, with sliding windows too."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from octavo.paging import BlockHasher, KVCacheManager, KVSeq
from octavo.paging.tier import DiskStore, KVTier, TierBlock
from octavo.paging.tier.record import TierRecordError, decode, encode, record_size

BS = 4
KEY = bytes(range(16))
TOKS = (5, 6, 7, 8)


def record(key: bytes = KEY, toks: tuple[int, ...] = TOKS, fill: int = 7,
           size: int = 64) -> tuple[list, int]:
    parts = encode(key, toks, bytes([fill]) * size)
    return parts, record_size(key, len(toks), size)


def raw(key: bytes = KEY, fill: int = 7) -> bytes:
    return b"".join(bytes(p) for p in record(key, fill=fill)[0])


# -- records ------------------------------------------------------------------------------------
def test_a_record_gives_back_its_payload() -> None:
    assert bytes(decode(raw(), KEY, TOKS)) == bytes([7]) * 64


@pytest.mark.parametrize("damage", ["truncated", "overlong", "flipped", "key", "tokens", "magic",
                                    "empty"])
def test_a_damaged_or_foreign_record_is_refused(damage) -> None:
    data, key, toks = bytearray(raw()), KEY, TOKS
    if damage == "truncated":
        data = data[:-1]
    elif damage == "overlong":
        data += b"\0"
    elif damage == "flipped":
        data[-3] ^= 1
    elif damage == "key":
        key = bytes(16)
    elif damage == "tokens":
        toks = (5, 6, 7, 9)
    elif damage == "magic":
        data[:4] = b"JUNK"
    else:
        data = bytearray()
    with pytest.raises(TierRecordError):
        decode(data, key, toks)


# -- the disk store -----------------------------------------------------------------------------
def test_stored_records_are_found_by_another_store_on_the_same_directory(tmp_path) -> None:
    a, b = DiskStore(tmp_path, 1 << 20), DiskStore(tmp_path, 1 << 20)
    assert not b.contains(KEY)
    assert a.put(KEY, *record())
    assert not a.put(KEY, *record())  # there already
    assert b.contains(KEY) and bytes(b.get(KEY)) == raw()
    assert DiskStore(tmp_path, 1 << 20).stats()["tier_blocks"] == 1  # a restart scans it
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [KEY.hex() + ".kvb"]


def test_the_least_recently_used_records_go_first(tmp_path) -> None:
    _, size = record()
    store = DiskStore(tmp_path, 3 * size)
    keys = [bytes([i]) * 16 for i in range(4)]
    for i, key in enumerate(keys[:3]):
        store.put(key, *record(key))
        os.utime(store.path(key), (1000 + i, 1000 + i))  # written in this order
    store.scan()
    assert store.get(keys[0]) is not None  # used again: the newest now
    store.put(keys[3], *record(keys[3]))
    assert [store.path(k).exists() for k in keys] == [True, False, False, True]
    assert store.stats()["tier_bytes"] == 2 * size and store.stats()["tier_evictions"] == 2


def test_a_vanished_directory_misses_then_is_made_again(tmp_path) -> None:
    root = tmp_path / "tier"
    store = DiskStore(root, 1 << 20)
    store.put(KEY, *record())
    os.rename(root, tmp_path / "elsewhere")
    assert store.get(KEY) is None
    assert store.stats()["tier_blocks"] == 0
    assert store.put(KEY, *record())
    assert bytes(store.get(KEY)) == raw()


def test_temporary_files_of_dead_writers_are_cleaned_up(tmp_path) -> None:
    store = DiskStore(tmp_path, 1 << 20)
    store.put(KEY, *record())
    stale = store.path(KEY).with_name(".x.1.2.tmp")
    stale.write_bytes(b"half a record")
    os.utime(stale, (0, 0))
    DiskStore(tmp_path, 1 << 20)
    assert not stale.exists() and store.path(KEY).exists()


RACE_KEYS = [bytes([i]) * 16 for i in range(6)]


def _rewrite(root: str, seed: int, rounds: int) -> None:
    """A writer process: drops and writes the race's records again and again, each time with
    another payload."""
    store = DiskStore(root, 1 << 30)
    for i in range(rounds):
        key = RACE_KEYS[(i + seed) % len(RACE_KEYS)]
        store.remove(key)
        store.put(key, *record(key, fill=(seed * 101 + i) % 251, size=1 << 16))


def test_a_reader_racing_two_writers_sees_whole_records_or_none(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_rewrite, args=(str(tmp_path), s, 400)) for s in (1, 2)]
    for w in writers:
        w.start()
    reader = DiskStore(tmp_path, 1 << 30)
    whole = missing = 0
    deadline = time.monotonic() + 60
    while any(w.is_alive() for w in writers) and time.monotonic() < deadline:
        for key in RACE_KEYS:
            data = reader.get(key)
            if data is None:
                missing += 1
                continue
            payload = bytes(decode(data, key, TOKS))  # raises on a partial record
            assert payload == payload[:1] * len(payload), "a record mixing two writes"
            whole += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert whole > 0
    assert not list(tmp_path.rglob("*.tmp"))


# -- the KV manager's side ----------------------------------------------------------------------
def mkseq(seq_id: int, tokens: list[int]) -> KVSeq:
    return KVSeq(seq_id, tokens, hasher=BlockHasher(BS))


def payload_of(block_id: int) -> bytes:
    return block_id.to_bytes(4, "little") * 8


def run_step(m: KVCacheManager) -> list[tuple[int, bytes]]:
    """What a runner does with a step's tier traffic: copy the saves out (here: bytes naming
    the block), and return the loads."""
    saves, loads = m.take_tier_io()
    m.tier_io_done([payload_of(b) for b in saves])
    return [(b, bytes(p)) for b, p in loads]


def manager(root: Path, num_blocks: int = 16, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, tier=KVTier(DiskStore(root, 1 << 20)), **kw)


def test_freed_blocks_are_saved_and_a_restart_loads_them(tmp_path) -> None:
    m = manager(tmp_path)
    tokens = list(range(10, 23))  # 3 full blocks and one token
    s = mkseq(1, tokens)
    assert m.allocate_slots(s, len(tokens), m.get_computed_blocks(s)) is not None
    held = m.block_table(1)
    assert run_step(m) == []
    m.free(1)
    assert m.has_tier_saves()
    saves, _ = m.take_tier_io()
    assert saves == held[2::-1]  # the full blocks, tail first as the free queued them
    m.tier_io_done([payload_of(b) for b in saves])
    assert m.tier.flush(10)

    again = manager(tmp_path)
    s2 = mkseq(1, tokens)
    cached = again.get_computed_blocks(s2)
    assert cached.num_tokens == 12 and all(isinstance(b, TierBlock) for b in cached.blocks[0])
    assert again.allocate_slots(s2, 1, cached) is not None
    new = again.block_table(1)
    assert run_step(again) == [(new[i], payload_of(held[i])) for i in range(3)]
    again.check_invariants()
    stats = again.stats()
    assert stats["tier_hit_tokens"] == 12 and stats["prefix_cache_hit_tokens"] == 12
    again.free(1)
    assert not again.has_tier_saves()  # the tier has them all already
    # a second sequence now hits the loaded blocks in the pool
    s3 = mkseq(2, tokens)
    assert all(not isinstance(b, TierBlock) for b in again.get_computed_blocks(s3).blocks[0])


def test_a_prefix_goes_on_in_the_tier_where_the_pool_lost_its_tail(tmp_path) -> None:
    m = manager(tmp_path, num_blocks=4)
    tokens = list(range(40, 53))
    m.allocate_slots(mkseq(1, tokens), len(tokens), None)
    run_step(m)
    m.free(1)
    run_step(m)
    assert m.tier.flush(10)
    other = mkseq(2, list(range(100, 112)))  # three blocks: the first's tail is evicted
    m.allocate_slots(other, 12, None)
    m.free(2)
    cached = m.get_computed_blocks(mkseq(3, tokens))
    kinds = [type(b).__name__ for b in cached.blocks[0]]
    assert kinds == ["KVBlock", "TierBlock", "TierBlock"]


def test_a_record_that_fails_its_check_is_recomputed_from_there(tmp_path) -> None:
    tokens = list(range(60, 77))  # 4 full blocks and one token
    m = manager(tmp_path)
    m.allocate_slots(mkseq(1, tokens), len(tokens), None)
    run_step(m)
    m.free(1)
    run_step(m)
    assert m.tier.flush(10)
    again = manager(tmp_path)
    s = mkseq(1, tokens)
    cached = again.get_computed_blocks(s)
    assert cached.num_tokens == 16
    third = again.tier.store.path(cached.blocks[0][2].key)
    third.write_bytes(third.read_bytes()[:-1])
    assert again.allocate_slots(s, 1, cached) is not None
    assert s.num_computed_tokens == 9  # two blocks loaded, one token of the third computed
    assert len(run_step(again)) == 2
    again.check_invariants()
    assert again.stats()["tier_read_failures"] == 1 and not third.exists()


def test_loads_of_a_sequence_freed_before_its_step_are_cancelled(tmp_path) -> None:
    tokens = list(range(10, 19))
    m = manager(tmp_path)
    m.allocate_slots(mkseq(1, tokens), len(tokens), None)
    run_step(m)
    m.free(1)
    run_step(m)
    assert m.tier.flush(10)
    again = manager(tmp_path)
    s = mkseq(1, tokens)
    again.allocate_slots(s, 1, again.get_computed_blocks(s))
    again.free(1)  # e.g. the rest of its request did not fit
    assert again.take_tier_io() == ([], [])
    again.check_invariants()
    assert again.stats()["kv_blocks_cached_free"] == 0  # nobody may hit a block never loaded


def test_a_failed_step_forgets_the_blocks_it_was_to_load(tmp_path) -> None:
    tokens = list(range(10, 19))
    m = manager(tmp_path)
    m.allocate_slots(mkseq(1, tokens), len(tokens), None)
    run_step(m)
    m.free(1)
    run_step(m)
    assert m.tier.flush(10)
    again = manager(tmp_path)
    s = mkseq(1, tokens)
    again.allocate_slots(s, 1, again.get_computed_blocks(s))
    again.take_tier_io()
    again.tier_io_failed()
    again.free(1)
    again.check_invariants()
    cached = again.get_computed_blocks(mkseq(2, tokens))
    assert all(isinstance(b, TierBlock) for b in cached.blocks[0])  # not the pool's


@pytest.mark.parametrize("windows", [(6,), (None, 6)], ids=["sliding", "hybrid"])
def test_window_hits_mix_pool_and_tier_blocks(tmp_path, windows) -> None:
    tokens = list(range(10, 31))  # 5 full blocks and one token
    m = manager(tmp_path, num_blocks=32, windows=windows)
    m.allocate_slots(mkseq(1, tokens), len(tokens), None)
    run_step(m)
    m.free(1)
    run_step(m)
    assert m.tier.flush(10)
    again = manager(tmp_path, num_blocks=32, windows=windows)
    s = mkseq(1, tokens)
    cached = again.get_computed_blocks(s)
    assert cached.num_tokens == 20
    sliding = cached.blocks[-1]
    assert sliding[:3] == (None, None, None) and all(isinstance(b, TierBlock)
                                                     for b in sliding[3:])
    assert again.allocate_slots(s, 1, cached) is not None
    loads = run_step(again)
    assert len(loads) == sum(b is not None for g in cached.blocks for b in g)
    again.check_invariants()
    # a second sequence finds the loaded blocks in the pool now
    s2 = mkseq(2, tokens + [99])
    assert all(b is None or not isinstance(b, TierBlock)
               for g in again.get_computed_blocks(s2).blocks for b in g)
