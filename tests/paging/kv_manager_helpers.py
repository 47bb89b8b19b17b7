"""Helpers shared by the KVCacheManager tests (test_kv_manager.py, test_kv_manager_fork_swap.py):
a manager of block size BS, sequences hashed as the engine hashes them, and starting, growing
and forking them with their block tables checked at each step; a snapshot of the manager's
state, to check that a refusal leaves nothing behind."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from octavo.paging import BlockHasher, KVCacheManager, KVSeq, NewBlocks

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
