"""Helpers shared by the sliding-window paging tests (test_kv_windows*.py): building sequences,
starting and growing them, and checking that a sequence's tables hold exactly its window.

A query at position p sees keys at positions (p - W, p], so once a sequence has computed n
tokens, the next query (at n) can still see the blocks from max(0, n - W + 1) // bs on.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from octavo.paging import BlockHasher, CachedPrefix, KVCacheManager, KVSeq


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_live(window: int | None, n: int, bs: int) -> int:
    """The first block the query after `n` computed tokens can still see."""
    return 0 if window is None else max(0, n - window + 1) // bs


def mkseq(seq_id: int, tokens: Iterable[int], bs: int, extra: Hashable | None = None) -> KVSeq:
    return KVSeq(seq_id, tokens, hasher=BlockHasher(bs), extra_key=extra)


def ids(blocks: Sequence) -> list[int | None]:
    return [None if b is None else b.block_id for b in blocks]


def snapshot(m: KVCacheManager, seqs: Iterable[KVSeq] = ()) -> tuple:
    seqs = tuple(seqs)
    running = [s for s in seqs if not m.seqs[s.seq_id].swapped]
    return (
        m.stats(),
        {s.seq_id: m.block_tables(s.seq_id) for s in running},
        {s.seq_id: s.num_computed_tokens for s in seqs},
        [b.block_id for b in m.block_pool.iter_free_blocks()],
        [b.block_id for b in m.cpu_pool.iter_free_blocks()],
        [(b.ref_cnt, b.num_filled, b.block_hash) for b in m.block_pool.blocks],
        [(b.ref_cnt, b.num_filled) for b in m.cpu_pool.blocks],
    )


def assert_trimmed(m: KVCacheManager, s: KVSeq) -> None:
    """Every sliding group holds exactly the blocks the next query can see; full groups all."""
    n, bs, null = s.num_computed_tokens, m.block_size, m.null_block_id
    for g, (w, table) in enumerate(zip(m.windows, m.block_tables(s.seq_id), strict=True)):
        assert len(table) == _cdiv(n, bs), f"group {g}: {len(table)} entries for {n} tokens"
        dead = first_live(w, n, bs)
        assert all(b == null for b in table[:dead]), f"group {g} holds a block before its window"
        assert null not in table[dead:], f"group {g} freed a block its window still sees"


def held(m: KVCacheManager, seq_id: int, g: int) -> int:
    return sum(b != m.null_block_id for b in m.block_tables(seq_id)[g])


def start(m: KVCacheManager, s: KVSeq, n: int | None = None, *, cache: bool = True) -> int:
    """Start `s` on its cached prefix (unless cache=False) with n more tokens (default: all)."""
    cached = m.get_computed_blocks(s) if cache else None
    hit = 0 if cached is None else cached.num_tokens
    new = m.allocate_slots(s, len(s.token_ids) - hit if n is None else n, cached)
    assert new is not None, f"could not start sequence {s.seq_id}"
    assert s.num_computed_tokens == hit + (len(s.token_ids) - hit if n is None else n)
    return hit


def decode(m: KVCacheManager, s: KVSeq, token: int) -> None:
    s.append_token(token)
    assert m.allocate_slots(s, 1) is not None, f"could not grow sequence {s.seq_id}"


def assert_all_returned(m: KVCacheManager) -> None:
    m.check_invariants()
    st_ = m.stats()
    assert st_["kv_blocks_used"] == 0 and m.num_free_blocks() == m.num_blocks
    assert st_["kv_cpu_blocks_used"] == 0 and m.cpu_pool.num_free_blocks == m.cpu_pool.num_blocks
    assert st_["kv_sliding_blocks_held_max"] == 0


def check_hit(m: KVCacheManager, s: KVSeq, cached: CachedPrefix) -> None:
    """The shape the brief promises: full groups every block, sliding groups the window only."""
    bs, n = m.block_size, cached.num_tokens
    assert n % bs == 0 and n < max(len(s.token_ids), 1)
    assert len(cached.blocks) == m.num_groups
    for g, (w, blocks) in enumerate(zip(m.windows, cached.blocks, strict=True)):
        assert len(blocks) == n // bs
        dead = first_live(w, n, bs)
        assert all(b is None for b in blocks[:dead]), f"group {g}: a block before the window"
        assert all(b is not None for b in blocks[dead:]), f"group {g}: a hole in the window"
        for i, b in enumerate(blocks):
            if b is not None:
                assert b.token_ids == tuple(s.token_ids[i * bs : (i + 1) * bs])
