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

from octavo.paging import KVCacheManager, OutOfKVBlocks, kv_manager

BS = 4
NUM_BLOCKS = 20
NUM_CPU_BLOCKS = 12
# Shared prompt prefixes (3 blocks each) so that prefix hits are common.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 1, 2, 3, 4], [7] * 12]
SMALL_TOKENS = st.integers(0, 4)  # a tiny alphabet makes equal blocks at different positions
EXTRA_KEYS = st.sampled_from([None, "adapter-a"])

Content = tuple[Hashable, tuple[int, ...]]


class PagedKVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.tokens: dict[int, list[int]] = {}
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
            {s: m.num_computed_tokens(s) for s in self.tokens},
            {s: m.block_table(s) for s in self.running()},
            [b.block_id for b in m.block_pool.iter_free_blocks()],
            [b.block_id for b in m.cpu_pool.iter_free_blocks()],
        )

    def expect_out_of_blocks(self, op, *args) -> None:
        before = self.snapshot()
        with pytest.raises(OutOfKVBlocks):
            op(*args)
        assert self.snapshot() == before, "a failed operation left state behind"

    # -- rules ----------------------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), extra=EXTRA_KEYS)
    def allocate(self, data, prefix: list[int], extra: Hashable) -> None:
        cut = data.draw(st.integers(0, len(prefix)), label="prefix length")
        prompt = prefix[:cut] + data.draw(st.lists(SMALL_TOKENS, max_size=9), label="suffix")
        if not prompt:
            prompt = [0]
        cached = self.mgr.find_cached_prefix(prompt, extra)
        assert cached % BS == 0 and 0 <= cached < len(prompt)
        n = data.draw(st.integers(1, len(prompt) - cached), label="chunk")
        seq_id = self.new_id()
        if not self.mgr.can_allocate(prompt, n, extra):
            self.expect_out_of_blocks(self.mgr.allocate, seq_id, prompt, n, extra)
            return
        assert self.mgr.allocate(seq_id, prompt, n, extra) == cached
        self.queried += len(prompt)
        self.hit += cached
        table = self.mgr.block_table(seq_id)
        for i in range(cached // BS):
            assert self.mgr.block_pool.blocks[table[i]].token_ids == tuple(
                prompt[i * BS : (i + 1) * BS]
            ), "a prefix hit returned a block holding other tokens"
        self.tokens[seq_id], self.extra[seq_id] = list(prompt), extra
        assert self.mgr.num_computed_tokens(seq_id) == cached + n
        self.write(seq_id, cached, cached + n)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def append(self, data) -> None:
        """Next prefill chunk, or one decode token once the prompt is done."""
        seq_id = data.draw(st.sampled_from(self.running()), label="seq")
        known = self.tokens[seq_id]
        start = self.mgr.num_computed_tokens(seq_id)
        if start < len(known):
            n, candidate = data.draw(st.integers(1, len(known) - start), label="chunk"), known
        else:
            n, candidate = 1, [*known, data.draw(SMALL_TOKENS, label="sampled")]
        table = self.mgr.block_table(seq_id)
        pool = self.mgr.block_pool
        shared = start % BS != 0 and pool.blocks[table[start // BS]].ref_cnt > 1
        if not self.mgr.can_append_slots(seq_id, n):
            self.expect_out_of_blocks(self.mgr.append_slots, seq_id, candidate, n)
            return
        self.mgr.append_slots(seq_id, candidate, n)
        self.tokens[seq_id] = candidate
        copies = self.mgr.take_block_copies()
        if shared:
            assert len(copies) == 1, f"writing into a shared block made {len(copies)} copies"
            new_table = self.mgr.block_table(seq_id)
            assert copies[0] == (table[start // BS], new_table[start // BS])
            assert new_table[: start // BS] == table[: start // BS]
        else:
            assert copies == [], "copied a block that was not shared"
        self.write(seq_id, start, start + n, copies)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self.running()), label="parent")
        child = self.new_id()
        self.mgr.fork(parent, child)
        self.tokens[child], self.extra[child] = list(self.tokens[parent]), self.extra[parent]
        assert self.mgr.block_table(child) == self.mgr.block_table(parent)
        assert self.mgr.num_computed_tokens(child) == self.mgr.num_computed_tokens(parent)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
        self.mgr.free(seq_id)
        del self.tokens[seq_id], self.extra[seq_id]
        self.cpu_tables.pop(seq_id, None)

    @rule(data=st.data())
    def pressure(self, data) -> None:
        """A long unrelated prompt that evicts cached blocks, overwrites them, then leaves."""
        prompt = data.draw(st.lists(st.integers(100, 10**6), min_size=8, max_size=48), label="p")
        seq_id = self.new_id()
        cached = self.mgr.find_cached_prefix(prompt)
        if not self.mgr.can_allocate(prompt, len(prompt) - cached):
            self.expect_out_of_blocks(self.mgr.allocate, seq_id, prompt, len(prompt) - cached)
            return
        self.mgr.allocate(seq_id, prompt, len(prompt) - cached)
        self.queried += len(prompt)
        self.hit += cached
        self.tokens[seq_id], self.extra[seq_id] = prompt, None
        self.write(seq_id, cached, len(prompt))
        self.check_kv_contents()
        self.mgr.free(seq_id)
        del self.tokens[seq_id], self.extra[seq_id]

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        group = data.draw(
            st.lists(st.sampled_from(self.running()), min_size=1, max_size=3, unique=True), "group"
        )
        tables = {s: self.mgr.block_table(s) for s in group}
        if not self.mgr.can_swap_out(group):
            self.expect_out_of_blocks(self.mgr.swap_out, group)
            return
        copies = self.mgr.swap_out(group)
        mapping = dict(copies)
        distinct = {b for t in tables.values() for b in t}
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
        if not self.mgr.can_swap_in(group):
            self.expect_out_of_blocks(self.mgr.swap_in, group)
            return
        copies = self.mgr.swap_in(group)
        distinct = {b for s in group for b in self.cpu_tables[s]}
        assert {c for c, _ in copies} <= distinct and len(copies) == len(dict(copies))
        for cpu, gpu in copies:
            self.copy_block(self.cpu_kv, cpu, self.gpu_kv, gpu)
        for s in group:
            del self.cpu_tables[s]

    # -- invariants -----------------------------------------------------------------------------
    def check_kv_contents(self) -> None:
        for s in self.tokens:
            n = self.mgr.num_computed_tokens(s)
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
            for pos in range(self.mgr.num_computed_tokens(s))
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
        self.mgr.check_invariants()
        assert self.mgr.num_free_blocks() == NUM_BLOCKS, "freeing everything must restore capacity"
        assert self.mgr.cpu_pool.num_free_blocks == NUM_CPU_BLOCKS
        assert self.mgr.usage() == 0.0
        # ... and all of it is usable again, cached blocks included.
        everything = list(range(-NUM_BLOCKS * BS, 0))  # no other prompt uses these
        self.mgr.allocate(self.new_id(), everything, len(everything))
        self.mgr.check_invariants()


def _weak_digest(parent_hash: bytes | None, token_ids, extra_key=None) -> bytes:
    """Three possible values, ignoring parent and extra key: different blocks collide all the
    time, at every position."""
    return bytes([sum(token_ids) % 3]) * 16


class CollidingDigestMachine(PagedKVMachine):
    """The same machine with a digest that collides constantly: verification must still hold."""

    def __init__(self) -> None:
        self._real_digest = kv_manager.hash_block_tokens
        kv_manager.hash_block_tokens = _weak_digest
        super().__init__()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            kv_manager.hash_block_tokens = self._real_digest


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
