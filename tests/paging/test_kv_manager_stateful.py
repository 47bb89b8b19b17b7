"""Random sequences of every KV manager operation, checked against a fake KV cache.

The fake cache stores, for every physical slot the runner would write, what real KV depends on:
the sequence's extra key and its whole token prefix up to that position. Copies (copy-on-write,
swap) are applied the way the runner would. After every step each live sequence must read back
exactly its own prefix through its block table, so a wrong prefix hit, a missed copy-on-write, a
write into a slot another sequence can see, or a bad swap mapping all show up as a mismatch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from octavo.paging import BlockHasher, CachedPrefix, KVCacheManager, KVSeq, NewBlocks, block_hash

BS = 4
NUM_BLOCKS = 20
NUM_CPU_BLOCKS = 12
# Shared prompt prefixes (3 blocks each) so that prefix hits are common.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 1, 2, 3, 4], [7] * 12]
SMALL_TOKENS = st.integers(0, 4)  # a tiny alphabet makes equal blocks at different positions
EXTRA_KEYS = st.sampled_from([None, "adapter-a"])

Content = tuple[Hashable, tuple[int, ...]]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def new_seq(seq_id: int, tokens, extra_key: Hashable = None) -> KVSeq:
    return KVSeq(seq_id, tokens, hasher=BlockHasher(BS), extra_key=extra_key)


class PagedKVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.seqs: dict[int, KVSeq] = {}  # every live sequence, running or swapped out
        self.tokens: dict[int, list[int]] = {}  # what each sequence's tokens must be
        self.extra: dict[int, Hashable] = {}
        self.cpu_tables: dict[int, list[int]] = {}  # swapped-out sequences
        self.gpu_kv: dict[int, Content] = {}
        self.cpu_kv: dict[int, Content] = {}
        self.next_id = 0
        self.queried = self.hit = 0

    # -- the fake runner ------------------------------------------------------------------------
    def content(self, seq_id: int, pos: int) -> Content:
        return self.extra[seq_id], tuple(self.tokens[seq_id][: pos + 1])

    @staticmethod
    def copy_block(src_kv: dict, src: int, dst_kv: dict, dst: int) -> None:
        for off in range(BS):
            if src * BS + off in src_kv:
                dst_kv[dst * BS + off] = src_kv[src * BS + off]
            else:
                dst_kv.pop(dst * BS + off, None)

    def write(self, seq_id: int, start: int, end: int, copies=None) -> None:
        """Apply pending copies, then write the step's new tokens, as the runner would."""
        if copies is None:
            copies = self.mgr.take_block_copies()
        for src, dst in copies:
            self.copy_block(self.gpu_kv, src, self.gpu_kv, dst)
        table = self.mgr.block_table(seq_id)
        for pos in range(start, end):
            blk = table[pos // BS]
            assert self.mgr.block_pool.blocks[blk].ref_cnt == 1, (
                f"seq {seq_id} writes into block {blk}, which other sequences can read"
            )
            self.gpu_kv[blk * BS + pos % BS] = self.content(seq_id, pos)

    # -- helpers --------------------------------------------------------------------------------
    def running(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.cpu_tables)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def snapshot(self) -> tuple:
        m = self.mgr
        return (
            m.stats(),
            {s: q.num_computed_tokens for s, q in self.seqs.items()},
            {s: m.block_table(s) for s in self.running()},
            [b.block_id for b in m.block_pool.iter_free_blocks()],
            [b.block_id for b in m.cpu_pool.iter_free_blocks()],
            [(b.ref_cnt, b.num_filled, b.block_hash) for b in m.block_pool.blocks],
        )

    def expect_refused(self, before: tuple, must_refuse: bool, what: str) -> None:
        """After an operation returned None: it had to, and it changed nothing."""
        assert must_refuse, f"{what} was refused although the free blocks suffice"
        assert self.snapshot() == before, "a failed operation left state behind"
        assert self.mgr.take_block_copies() == [], "a failed operation recorded a copy"

    def admit(self, s: KVSeq, n: int, cached: CachedPrefix) -> bool:
        """Start a new sequence on its cached prefix with `n` more tokens; False when refused."""
        m = self.mgr
        # A hit on a cached-free block takes it off the free list; a hit on a used one is free.
        needed = (
            sum(b.ref_cnt == 0 for b in cached.blocks[0])
            + _cdiv(cached.num_tokens + n, BS)
            - len(cached.blocks[0])
        )
        free = m.num_free_blocks()
        before = self.snapshot()
        new = m.allocate_slots(s, n, cached)
        if new is None:
            self.expect_refused(before, needed > free, f"starting sequence {s.seq_id}")
            assert s.num_computed_tokens == 0
            with pytest.raises(KeyError):
                m.block_table(s.seq_id)
            return False
        assert m.num_free_blocks() == free - needed, "a start took the wrong number of blocks"
        assert new == NewBlocks(0, m.block_table(s.seq_id)), "a start returns the whole table"
        assert s.num_computed_tokens == cached.num_tokens + n
        self.queried += len(s.token_ids)
        self.hit += cached.num_tokens
        self.seqs[s.seq_id] = s
        self.tokens[s.seq_id], self.extra[s.seq_id] = list(s.token_ids), s.extra_key
        return True

    # -- rules ----------------------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), extra=EXTRA_KEYS)
    def allocate(self, data, prefix: list[int], extra: Hashable) -> None:
        cut = data.draw(st.integers(0, len(prefix)), label="prefix length")
        prompt = prefix[:cut] + data.draw(st.lists(SMALL_TOKENS, max_size=9), label="suffix")
        if not prompt:
            prompt = [0]
        seq_id = self.new_id()
        s = new_seq(seq_id, prompt, extra)
        cached = self.mgr.get_computed_blocks(s)
        nc = cached.num_tokens
        assert nc % BS == 0 and 0 <= nc < len(prompt) and len(cached.blocks[0]) * BS == nc
        n = data.draw(st.integers(1, len(prompt) - nc), label="chunk")
        if not self.admit(s, n, cached):
            return
        table = self.mgr.block_table(seq_id)
        assert table[: nc // BS] == [b.block_id for b in cached.blocks[0]]
        for i in range(nc // BS):
            assert self.mgr.block_pool.blocks[table[i]].token_ids == tuple(
                prompt[i * BS : (i + 1) * BS]
            ), "a prefix hit returned a block holding other tokens"
        self.write(seq_id, nc, nc + n)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def append(self, data) -> None:
        """Next prefill chunk, or one decode token once the prompt is done."""
        seq_id = data.draw(st.sampled_from(self.running()), label="seq")
        s, known = self.seqs[seq_id], self.tokens[seq_id]
        start = s.num_computed_tokens
        if start < len(known):
            n = data.draw(st.integers(1, len(known) - start), label="chunk")
        else:
            n = 1
            token = data.draw(SMALL_TOKENS, label="sampled")
            s.append_token(token)  # known from now on, even if its slot has to wait
            known.append(token)
        table = self.mgr.block_table(seq_id)
        pool = self.mgr.block_pool
        shared = start % BS != 0 and pool.blocks[table[start // BS]].ref_cnt > 1
        needed = _cdiv(start + n, BS) - len(table) + shared
        free = self.mgr.num_free_blocks()
        before = self.snapshot()
        new = self.mgr.allocate_slots(s, n)
        if new is None:
            self.expect_refused(before, needed > free, f"growing sequence {seq_id}")
            return
        assert self.mgr.num_free_blocks() == free - needed, "growth took the wrong number of blocks"
        assert s.num_computed_tokens == start + n
        copies = self.mgr.take_block_copies()
        new_table = self.mgr.block_table(seq_id)
        if shared:
            assert len(copies) == 1, f"writing into a shared block made {len(copies)} copies"
            assert copies[0] == (table[start // BS], new_table[start // BS])
            assert new_table[: start // BS] == table[: start // BS]
            assert new.start == start // BS, "NewBlocks must start at the copy"
        else:
            assert copies == [], "copied a block that was not shared"
            assert new_table[: len(table)] == table and new.start == len(table)
        assert new.block_ids == new_table[new.start :]
        self.write(seq_id, start, start + n, copies)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self.running()), label="parent")
        p = self.seqs[parent]
        child = self.new_id()
        c = p.child(child)
        self.mgr.fork(parent, c)
        self.seqs[child] = c
        self.tokens[child], self.extra[child] = list(self.tokens[parent]), self.extra[parent]
        assert self.mgr.block_table(child) == self.mgr.block_table(parent)
        assert c.num_computed_tokens == p.num_computed_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        self.mgr.free(seq_id)
        s = self.seqs.pop(seq_id)
        assert s.num_computed_tokens == 0, "free resets the computed-token count"
        del self.tokens[seq_id], self.extra[seq_id]
        self.cpu_tables.pop(seq_id, None)

    @rule(data=st.data())
    def pressure(self, data) -> None:
        """A long unrelated prompt that evicts cached blocks, overwrites them, then leaves."""
        prompt = data.draw(st.lists(st.integers(100, 10**6), min_size=8, max_size=48), label="p")
        seq_id = self.new_id()
        s = new_seq(seq_id, prompt)
        cached = self.mgr.get_computed_blocks(s)
        if not self.admit(s, len(prompt) - cached.num_tokens, cached):
            return
        self.write(seq_id, cached.num_tokens, len(prompt))
        self.check_kv_contents()
        self.mgr.free(seq_id)
        del self.seqs[seq_id], self.tokens[seq_id], self.extra[seq_id]

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        group = data.draw(
            st.lists(st.sampled_from(self.running()), min_size=1, max_size=3, unique=True), "group"
        )
        tables = {s: self.mgr.block_table(s) for s in group}
        distinct = {b for t in tables.values() for b in t}
        free = self.mgr.cpu_pool.num_free_blocks
        before = self.snapshot()
        copies = self.mgr.swap_out(group)
        if copies is None:
            self.expect_refused(before, len(distinct) > free, f"swapping out {group}")
            return
        mapping = dict(copies)
        assert set(mapping) == distinct and len(copies) == len(distinct), "each block copied once"
        assert len(set(mapping.values())) == len(mapping), "two GPU blocks copied to one CPU block"
        for gpu, cpu in copies:
            self.copy_block(self.gpu_kv, gpu, self.cpu_kv, cpu)
        for s, table in tables.items():
            self.cpu_tables[s] = [mapping[b] for b in table]

    @precondition(lambda self: self.cpu_tables)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        swapped = sorted(self.cpu_tables)
        group = data.draw(st.lists(st.sampled_from(swapped), min_size=1, unique=True), "group")
        distinct = {b for s in group for b in self.cpu_tables[s]}
        free = self.mgr.num_free_blocks()
        before = self.snapshot()
        copies = self.mgr.swap_in(group)
        if copies is None:
            # Each distinct CPU block takes at most one free GPU block (a copy, or reviving the
            # cached block it reuses), so a group with no more than that many must fit.
            self.expect_refused(before, len(distinct) > free, f"swapping in {group}")
            return
        assert {c for c, _ in copies} <= distinct and len(copies) == len(dict(copies))
        for cpu, gpu in copies:
            self.copy_block(self.cpu_kv, cpu, self.gpu_kv, gpu)
        for s in group:
            del self.cpu_tables[s]

    # -- invariants -----------------------------------------------------------------------------
    def check_kv_contents(self) -> None:
        for s in self.tokens:
            n = self.seqs[s].num_computed_tokens
            swapped = s in self.cpu_tables
            table = self.cpu_tables[s] if swapped else self.mgr.block_table(s)
            kv = self.cpu_kv if swapped else self.gpu_kv
            assert len(table) == -(-n // BS), "paging must not hold blocks beyond the tokens"
            for pos in range(n):
                got = kv.get(table[pos // BS] * BS + pos % BS)
                assert got == self.content(s, pos), (
                    f"seq {s} reads wrong KV at position {pos}: {got} != {self.content(s, pos)}"
                )

    @invariant()
    def manager_invariants(self) -> None:
        self.mgr.check_invariants()

    @invariant()
    def kv_contents_match(self) -> None:
        self.check_kv_contents()

    @invariant()
    def sequences_hold_their_tokens_and_hashes(self) -> None:
        assert self.seqs.keys() == self.tokens.keys()
        for s, q in self.seqs.items():
            assert q.token_ids == self.tokens[s], f"seq {s}: its tokens changed under it"
            assert q.block_hashes == new_seq(0, q.token_ids, q.extra_key).block_hashes, (
                f"seq {s}: block hashes out of step with its tokens"
            )

    @invariant()
    def blocks_free_xor_referenced(self) -> None:
        for pool, tables in (
            (self.mgr.block_pool, [self.mgr.block_table(s) for s in self.running()]),
            (self.mgr.cpu_pool, list(self.cpu_tables.values())),
        ):
            holders = Counter(b for t in tables for b in t)
            free = [b.block_id for b in pool.iter_free_blocks()]
            assert len(free) == len(set(free)), "a block is queued twice"
            for blk in pool.blocks:
                assert blk.ref_cnt == holders[blk.block_id], (
                    f"block {blk.block_id}: ref {blk.ref_cnt}, in {holders[blk.block_id]} tables"
                )
                assert (blk.block_id in free) != (blk.ref_cnt > 0), (
                    f"block {blk.block_id} must be free or referenced, not both or neither"
                )

    @invariant()
    def stats_add_up(self) -> None:
        st_ = self.mgr.stats()
        total = NUM_BLOCKS * BS
        parts = ("live", "internal_waste", "reserved_waste", "external_waste", "free")
        assert sum(st_[f"kv_slots_{p}"] for p in parts) == total
        assert st_["kv_slots_reserved_waste"] == st_["kv_slots_external_waste"] == 0
        tables = {s: self.mgr.block_table(s) for s in self.running()}
        live_slots = {
            t[pos // BS] * BS + pos % BS
            for s, t in tables.items()
            for pos in range(self.seqs[s].num_computed_tokens)
        }
        used = {b for t in tables.values() for b in t}
        assert st_["kv_slots_live"] == len(live_slots)
        assert st_["kv_blocks_used"] == len(used)
        assert st_["kv_blocks_saved_by_sharing"] == sum(map(len, tables.values())) - len(used)
        assert st_["kv_cpu_blocks_used"] == len({b for t in self.cpu_tables.values() for b in t})
        assert st_["prefix_cache_query_tokens"] == self.queried
        assert st_["prefix_cache_hit_tokens"] == self.hit

    def teardown(self) -> None:
        for s in list(self.tokens):
            self.mgr.free(s)
            assert self.seqs[s].num_computed_tokens == 0
        self.mgr.check_invariants()
        assert self.mgr.num_free_blocks() == NUM_BLOCKS, "freeing everything must restore capacity"
        assert self.mgr.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS
        assert self.mgr.usage() == 0.0
        # ... and all of it is usable again, cached blocks included.
        everything = list(range(-NUM_BLOCKS * BS, 0))  # no other prompt uses these
        s = new_seq(self.new_id(), everything)
        new = self.mgr.allocate_slots(s, len(everything), self.mgr.get_computed_blocks(s))
        assert new is not None and len(new.block_ids) == NUM_BLOCKS
        self.mgr.check_invariants()


def _weak_digest(parent_hash: bytes | None, token_ids, extra_key=None) -> bytes:
    """Three possible values, ignoring parent and extra key: different blocks collide all the
    time, at every position."""
    return bytes([sum(token_ids) % 3]) * 16


class CollidingDigestMachine(PagedKVMachine):
    """The same machine with a digest that collides constantly: verification must still hold."""

    def __init__(self) -> None:
        self._real_digest = block_hash.hash_block_tokens
        block_hash.hash_block_tokens = _weak_digest  # what BlockHasher calls
        try:
            assert new_seq(0, [1] * BS).block_hashes == [_weak_digest(None, [1] * BS)]
        except AssertionError:
            block_hash.hash_block_tokens = self._real_digest
            raise
        super().__init__()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            block_hash.hash_block_tokens = self._real_digest


_settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPagedKVMachine = PagedKVMachine.TestCase
TestPagedKVMachine.settings = _settings
TestCollidingDigestMachine = CollidingDigestMachine.TestCase
TestCollidingDigestMachine.settings = _settings
