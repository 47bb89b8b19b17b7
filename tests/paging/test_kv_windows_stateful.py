"""Sliding-window paging in KVCacheManager: a random walk over windows, block sizes and group
layouts (full + sliding groups) through every operation (start with prefix hits, growth,
free_out_of_window, fork, free, swap out and in), checked against a fake KV cache.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from octavo.paging import KVCacheManager, KVSeq
from tests.paging.kv_windows_helpers import (
    _cdiv,
    assert_all_returned,
    assert_trimmed,
    check_hit,
    first_live,
    mkseq,
    snapshot,
)

# -- 5. random walk over windows, block sizes and group layouts ----------------------------------
PREFIXES = [list(range(1, 25)), [1, 2, 3, 4, 9, 9, 9, 9] * 3, [7] * 24]
SMALL_TOKENS = st.integers(0, 3)
WINDOW = st.one_of(st.none(), st.integers(1, 12))


class WindowedKVMachine(RuleBasedStateMachine):
    """Every operation on random layouts, against a fake KV cache that stores, for every slot
    the runner writes, (group, extra key, the whole token prefix up to that position). Each
    live sequence must read back exactly its own content in every block it still holds."""

    @initialize(
        bs=st.integers(1, 4),
        windows=st.lists(WINDOW, min_size=1, max_size=3).map(tuple),
        num_blocks=st.integers(6, 40),
        num_cpu_blocks=st.integers(0, 24),
        caching=st.booleans(),
    )
    def setup(self, bs, windows, num_blocks, num_cpu_blocks, caching) -> None:
        self.bs, self.windows = bs, windows
        self.mgr = KVCacheManager(num_blocks, bs, enable_prefix_caching=caching,
                                  num_cpu_blocks=num_cpu_blocks, windows=windows)
        self.null = num_blocks
        self.seqs: dict[int, KVSeq] = {}
        self.cpu_tables: dict[int, list[list[int | None]]] = {}  # swapped-out sequences
        self.trimmed: set[int] = set()  # free_out_of_window ran since the last allocation
        self.gpu_kv: dict[tuple[int, int], tuple] = {}
        self.cpu_kv: dict[tuple[int, int], tuple] = {}
        self.next_id = 0

    # -- the fake runner ------------------------------------------------------------------------
    def content(self, s: KVSeq, g: int, pos: int) -> tuple:
        return g, s.extra_key, tuple(s.token_ids[: pos + 1])

    def copy(self, src_kv: dict, src: int, dst_kv: dict, dst: int) -> None:
        for off in range(self.bs):
            if (src, off) in src_kv:
                dst_kv[dst, off] = src_kv[src, off]
            else:
                dst_kv.pop((dst, off), None)

    def write(self, s: KVSeq, start: int, end: int) -> None:
        for src, dst in self.mgr.take_block_copies():
            self.copy(self.gpu_kv, src, self.gpu_kv, dst)
        pool = self.mgr.block_pool
        for g, table in enumerate(self.mgr.block_tables(s.seq_id)):
            for pos in range(start, end):
                blk = table[pos // self.bs]
                assert blk != self.null, f"seq {s.seq_id} group {g}: no block for {pos}"
                assert pool.blocks[blk].ref_cnt == 1, f"writes into shared block {blk}"
                self.gpu_kv[blk, pos % self.bs] = self.content(s, g, pos)

    # -- helpers --------------------------------------------------------------------------------
    def running(self) -> list[int]:
        return sorted(s for s in self.seqs if s not in self.cpu_tables)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def snap(self) -> tuple:
        return snapshot(self.mgr, self.seqs.values())

    # -- rules ----------------------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), extra=st.sampled_from([None, "a"]),
          use_cache=st.booleans())
    def admit(self, data, prefix, extra, use_cache) -> None:
        m, bs = self.mgr, self.bs
        cut = data.draw(st.integers(0, len(prefix)), label="prefix length")
        prompt = prefix[:cut] + data.draw(st.lists(SMALL_TOKENS, max_size=8), label="suffix")
        prompt = prompt or [0]
        s = mkseq(self.new_id(), prompt, bs, extra)
        cached = m.get_computed_blocks(s)
        check_hit(m, s, cached)
        if not m.enable_prefix_caching:
            assert cached.num_tokens == 0
        if not use_cache:
            cached = None
        hit = 0 if cached is None else cached.num_tokens
        n = data.draw(st.integers(1, len(prompt) - hit), label="chunk")
        live = [] if cached is None else [b for grp in cached.blocks for b in grp if b]
        needed = sum(b.ref_cnt == 0 for b in live) + (_cdiv(hit + n, bs) - hit // bs) * len(
            self.windows)
        free, before = m.num_free_blocks(), self.snap()
        new = m.allocate_slots(s, n, cached)
        if new is None:
            assert needed > free, "a start was refused although the free blocks suffice"
            assert self.snap() == before and s.num_computed_tokens == 0
            return
        assert m.num_free_blocks() == free - needed
        assert s.num_computed_tokens == hit + n
        assert [new.block_ids, *(b for _, b in new.other_groups)] == m.block_tables(s.seq_id)
        self.seqs[s.seq_id] = s
        self.write(s, hit, hit + n)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), trim_first=st.booleans())
    def grow(self, data, trim_first) -> None:
        m, bs = self.mgr, self.bs
        s = self.seqs[data.draw(st.sampled_from(self.running()), label="seq")]
        k = s.num_computed_tokens
        if k < len(s.token_ids):
            n = data.draw(st.integers(1, len(s.token_ids) - k), label="chunk")
        else:
            n = 1
            s.append_token(data.draw(SMALL_TOKENS, label="sampled"))
        if trim_first:  # as the scheduler does after each step
            m.free_out_of_window(s.seq_id)
        tables = m.block_tables(s.seq_id)
        pool = m.block_pool
        cow = [k % bs != 0 and t[k // bs] != self.null and pool.blocks[t[k // bs]].ref_cnt > 1
               for t in tables]
        needed = (_cdiv(k + n, bs) - len(tables[0])) * len(self.windows) + sum(cow)
        free, before = m.num_free_blocks(), self.snap()
        new = m.allocate_slots(s, n)
        if new is None:
            assert s.num_computed_tokens == k
            if trim_first:
                assert needed > free, "growth was refused although the free blocks suffice"
                assert self.snap() == before, "a refused growth left state behind"
                assert m.take_block_copies() == []
            return
        self.trimmed.discard(s.seq_id)
        assert s.num_computed_tokens == k + n
        if trim_first:
            assert m.num_free_blocks() == free - needed
        after = m.block_tables(s.seq_id)
        for g, (gstart, gids) in enumerate([(new.start, new.block_ids), *new.other_groups]):
            assert gstart == (k // bs if cow[g] else len(tables[g]))
            assert gids == after[g][gstart:]
        self.write(s, k, k + n)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def trim(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.running()), label="seq")
        s = self.seqs[seq_id]
        n, bs = s.num_computed_tokens, self.bs
        expect = sum(b != self.null for g, (w, t) in enumerate(
            zip(self.windows, self.mgr.block_tables(seq_id), strict=True))
            for b in t[: first_live(w, n, bs)])
        freed_before = self.mgr.stats()["kv_blocks_freed_out_of_window"]
        assert self.mgr.free_out_of_window(seq_id) == expect
        assert self.mgr.stats()["kv_blocks_freed_out_of_window"] == freed_before + expect
        self.trimmed.add(seq_id)
        assert_trimmed(self.mgr, s)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.seqs[data.draw(st.sampled_from(self.running()), label="parent")]
        child = parent.child(self.new_id())
        self.mgr.fork(parent.seq_id, child)
        self.seqs[child.seq_id] = child
        if parent.seq_id in self.trimmed:
            self.trimmed.add(child.seq_id)
        assert self.mgr.block_tables(child.seq_id) == self.mgr.block_tables(parent.seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)), label="seq")
        self.mgr.free(seq_id)
        assert self.seqs.pop(seq_id).num_computed_tokens == 0
        self.cpu_tables.pop(seq_id, None)
        self.trimmed.discard(seq_id)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        m = self.mgr
        group = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=3,
                                   unique=True), label="group")
        copies = m.swap_out(group)
        if copies is None:  # it trimmed first: compare with the trimmed state
            for seq_id in group:
                assert m.free_out_of_window(seq_id) == 0
                self.trimmed.add(seq_id)
            distinct = {b for s in group for t in m.block_tables(s) for b in t if b != self.null}
            assert len(distinct) > m.cpu_pool.num_free_blocks
            return
        mapping = dict(copies)
        assert len(mapping) == len(copies) == len(set(mapping.values()))
        for gpu, cpu in copies:
            self.copy(self.gpu_kv, gpu, self.cpu_kv, cpu)
        for seq_id in group:
            self.trimmed.add(seq_id)  # swap_out trims what nobody reads any more
            state = m.seqs[seq_id]
            self.cpu_tables[seq_id] = [[None if b is None else b.block_id for b in t]
                                       for t in state.blocks]
            s = self.seqs[seq_id]
            for w, t in zip(self.windows, self.cpu_tables[seq_id], strict=True):
                dead = first_live(w, s.num_computed_tokens, self.bs)
                assert all(b is None for b in t[:dead]) and None not in t[dead:]
        used = {b for t_ in self.cpu_tables.values() for t in t_ for b in t if b is not None}
        assert m.stats()["kv_cpu_blocks_used"] == len(used)

    @precondition(lambda self: self.cpu_tables)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        m = self.mgr
        group = data.draw(st.lists(st.sampled_from(sorted(self.cpu_tables)), min_size=1,
                                   unique=True), label="group")
        distinct = {b for s in group for t in self.cpu_tables[s] for b in t if b is not None}
        free, before = m.num_free_blocks(), self.snap()
        copies = m.swap_in(group)
        if copies is None:
            assert len(distinct) > free, "a swap-in was refused although the blocks suffice"
            assert self.snap() == before
            return
        for cpu, gpu in copies:
            self.copy(self.cpu_kv, cpu, self.gpu_kv, gpu)
        for seq_id in group:
            old = self.cpu_tables.pop(seq_id)
            now = m.block_tables(seq_id)
            for a, b in zip(old, now, strict=True):
                assert [x is None for x in a] == [y == self.null for y in b], (
                    "swap-in changed which entries are freed")

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def manager_invariants(self) -> None:
        self.mgr.check_invariants()

    @invariant()
    def windows_hold(self) -> None:
        bs = self.bs
        for seq_id, s in self.seqs.items():
            n = s.num_computed_tokens
            swapped = seq_id in self.cpu_tables
            tables = self.cpu_tables[seq_id] if swapped else [
                [None if b == self.null else b for b in t]
                for t in self.mgr.block_tables(seq_id)]
            kv = self.cpu_kv if swapped else self.gpu_kv
            for g, (w, table) in enumerate(zip(self.windows, tables, strict=True)):
                assert len(table) == _cdiv(n, bs)
                dead = first_live(w, n, bs)
                assert None not in table[dead:], f"seq {seq_id} group {g}: window block freed"
                if seq_id in self.trimmed:
                    assert all(b is None for b in table[:dead]), (
                        f"seq {seq_id} group {g} holds a block before its window after "
                        "free_out_of_window")
                    if w is not None and not swapped:
                        assert sum(b is not None for b in table) <= _cdiv(w, bs) + 1
                for i, blk in enumerate(table):
                    if blk is None:
                        continue
                    for pos in range(i * bs, min(n, (i + 1) * bs)):
                        got = kv.get((blk, pos % bs))
                        assert got == self.content(s, g, pos), (
                            f"seq {seq_id} group {g} reads wrong KV at {pos}: {got}")

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for seq_id in list(self.seqs):
            self.mgr.free(seq_id)
        assert_all_returned(self.mgr)


TestWindowedKVMachine = WindowedKVMachine.TestCase
TestWindowedKVMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
