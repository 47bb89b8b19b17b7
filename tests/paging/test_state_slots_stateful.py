"""Random sequences of KV manager operations on a model with recurrent layers, checked against a
fake state store.

The fake runner keeps, for every state slot, which state it holds: (extra key, the token prefix
it has consumed). It executes each step as the real one does: the recorded state transfers in
order, then every chunk, which must find exactly the state of its sequence's computed prefix in
the sequence's slot (the zero state at position 0), writes the snapshots the step asked for,
and leaves the state after its last token. So a prefix hit restoring the wrong snapshot, a
missed copy-on-write after a fork, a snapshot registered under the wrong prefix, a transfer run
out of order or a bad swap mapping all show up as a mismatch. Slots never leak: every
invariant holds after every step, and freeing everything returns every slot.
"""

from __future__ import annotations

from collections.abc import Hashable

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from octavo.paging import BlockHasher, KVCacheManager, KVSeq

BS = 4
NUM_BLOCKS = 40
NUM_SLOTS = 7
NUM_CPU_SLOTS = 3
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 1, 2, 3, 4], [7] * 12]
SMALL_TOKENS = st.integers(0, 4)
EXTRA_KEYS = st.sampled_from([None, "adapter-a"])

State = tuple[Hashable, tuple[int, ...]]


def new_seq(seq_id: int, tokens, extra_key: Hashable = None) -> KVSeq:
    return KVSeq(seq_id, tokens, hasher=BlockHasher(BS), extra_key=extra_key)


class StateSlotsMachine(RuleBasedStateMachine):
    windows: tuple[int | None, ...] = (None,)

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, num_cpu_blocks=NUM_BLOCKS,
                                  windows=self.windows, num_state_slots=NUM_SLOTS,
                                  num_cpu_state_slots=NUM_CPU_SLOTS)
        self.seqs: dict[int, KVSeq] = {}
        self.swapped: set[int] = set()
        self.device: dict[int, State] = {}  # state slot -> the state it holds
        self.host: dict[int, State] = {}
        self.next_id = 0
        self.hits = 0

    # -- the fake runner ------------------------------------------------------------------------
    def state_of(self, seq: KVSeq, n: int) -> State:
        return seq.extra_key, tuple(seq.token_ids[:n])

    def slot(self, seq_id: int) -> int:
        return self.mgr.block_tables(seq_id)[-1][0]

    def run_step(self, chunks: list[tuple[KVSeq, int, int]]) -> None:
        """Execute a step as the runner would: transfers in order, then each chunk
        [start, end) from the state its slot holds, snapshots included; then commit."""
        transfers, snapshots = self.mgr.take_state_ops()
        for kind, src, dst in transfers:
            if kind == "copy":
                self.copy(self.device, src, self.device, dst)
            elif kind == "out":
                self.copy(self.device, src, self.host, dst)
            else:
                assert kind == "in", kind
                self.copy(self.host, src, self.device, dst)
        asked = {}
        for seq_id, pos, slot in snapshots:
            assert seq_id not in asked, "two snapshots for one chunk"
            asked[seq_id] = (pos, slot)
        slots = [self.slot(s.seq_id) for s, _, _ in chunks]
        assert len(set(slots)) == len(slots), "two chunks of one step write one state slot"
        for (seq, start, end), slot in zip(chunks, slots, strict=True):
            if start:
                assert self.device.get(slot) == self.state_of(seq, start), (
                    f"seq {seq.seq_id} starts its chunk at {start} from the wrong state")
            if seq.seq_id in asked:
                pos, snap = asked.pop(seq.seq_id)
                assert start < pos < end and pos % BS == 0, f"snapshot at {pos} in [{start}, {end})"
                assert snap not in slots, "a snapshot written into a working slot"
                self.device[snap] = self.state_of(seq, pos)
            self.device[slot] = self.state_of(seq, end)
        assert not asked, f"snapshots for sequences without a chunk: {asked}"
        for seq, _, _ in chunks:
            self.mgr.commit_step(seq.seq_id)

    @staticmethod
    def copy(src_store: dict, src: int, dst_store: dict, dst: int) -> None:
        if src in src_store:
            dst_store[dst] = src_store[src]
        else:
            dst_store.pop(dst, None)

    # -- helpers --------------------------------------------------------------------------------
    def running(self) -> list[int]:
        return sorted(s for s in self.seqs if s not in self.swapped)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def snapshot(self) -> tuple:
        m = self.mgr
        assert m.state is not None
        return (m.stats(), {s: q.num_computed_tokens for s, q in self.seqs.items()},
                [(b.ref_cnt, b.block_hash) for b in m.state.pool.blocks],
                [(b.ref_cnt, b.block_hash) for b in m.block_pool.blocks])

    def recorded(self) -> tuple[int, int]:
        """State ops recorded and not yet taken (read, not taken)."""
        state = self.mgr.state
        return len(state._transfers), len(state._snapshots)

    def prompt(self, data, prefix: list[int]) -> list[int]:
        cut = data.draw(st.integers(0, len(prefix)), label="prefix length")
        tokens = prefix[:cut] + data.draw(st.lists(SMALL_TOKENS, max_size=9), label="suffix")
        return tokens or [0]

    def admit(self, data, prefix: list[int], extra: Hashable) -> tuple[KVSeq, int, int] | None:
        s = new_seq(self.new_id(), self.prompt(data, prefix), extra)
        cached = self.mgr.get_computed_blocks(s)
        nc = cached.num_tokens
        assert nc % BS == 0 and nc < len(s.token_ids)
        assert (cached.state is not None) == (nc > 0), "a hit comes with its state, and only a hit"
        n = data.draw(st.integers(1, len(s.token_ids) - nc), label="chunk")
        free_slots = self.mgr.state.pool.num_free_blocks
        before, ops = self.snapshot(), self.recorded()
        new = self.mgr.allocate_slots(s, n, cached)
        if new is None:
            assert self.snapshot() == before, "a refused start left state behind"
            assert free_slots == 0 or self.mgr.num_free_blocks() < NUM_BLOCKS, (
                "a start was refused with a free slot and free blocks")
            assert self.recorded() == ops, "a refused start recorded state ops"
            return None
        assert new.other_groups[-1] == (0, [self.slot(s.seq_id)]), "a start reports its slot"
        self.seqs[s.seq_id] = s
        self.hits += nc
        return s, nc, nc + n

    # -- rules ----------------------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES), extra=EXTRA_KEYS)
    def allocate(self, data, prefix, extra) -> None:
        chunk = self.admit(data, prefix, extra)
        if chunk is not None:
            self.run_step([chunk])

    @rule(data=st.data(), a=st.sampled_from(PREFIXES), b=st.sampled_from(PREFIXES))
    def allocate_two_in_one_step(self, data, a, b) -> None:
        """Both start before the step runs: the second's slot may evict the first's hit."""
        chunks = [c for c in (self.admit(data, a, None), self.admit(data, b, None)) if c]
        self.run_step(chunks)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def append(self, data) -> None:
        seq_id = data.draw(st.sampled_from(self.running()), label="seq")
        s = self.seqs[seq_id]
        start = s.num_computed_tokens
        if start < len(s.token_ids):
            n = data.draw(st.integers(1, len(s.token_ids) - start), label="chunk")
        else:
            n = 1
            s.append_token(data.draw(SMALL_TOKENS, label="sampled"))
        slot = self.slot(seq_id)
        shared = self.mgr.state.pool.blocks[slot].ref_cnt > 1
        self.mgr.free_out_of_window(seq_id)  # growth frees these first, whether it fits or not
        before = self.snapshot()
        new = self.mgr.allocate_slots(s, n)
        if new is None:
            assert self.snapshot() == before, "a refused growth left state behind"
            return
        moved = self.slot(seq_id) != slot
        assert moved == shared, "copy-on-write exactly when the slot is shared"
        assert new.other_groups[-1] == ((0, [self.slot(seq_id)]) if moved else (1, []))
        self.run_step([(s, start, start + n)])

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def append_then_fail(self, data) -> None:
        """The step that was to compute a chunk fails: the sequence is dropped, its snapshots
        with it, and nobody may find them."""
        seq_id = data.draw(st.sampled_from(self.running()), label="seq")
        s = self.seqs[seq_id]
        start = s.num_computed_tokens
        if start == len(s.token_ids):
            s.append_token(0)
        if self.mgr.allocate_slots(s, len(s.token_ids) - start) is None:
            return
        self.mgr.take_state_ops()  # never executed
        self.mgr.uncache_from(seq_id, start)
        self.mgr.free(seq_id)
        del self.seqs[seq_id]

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self.running()), label="parent")
        c = self.seqs[parent].child(self.new_id())
        self.mgr.fork(parent, c)
        self.seqs[c.seq_id] = c
        assert self.slot(c.seq_id) == self.slot(parent), "a fork shares the slot"

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)), label="seq")
        self.mgr.free(seq_id)
        self.seqs.pop(seq_id)
        self.swapped.discard(seq_id)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        group = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=3,
                                   unique=True), "group")
        for seq_id in group:  # swap_out frees these first, whether it moves anything or not
            self.mgr.free_out_of_window(seq_id)
        before = self.snapshot()
        if self.mgr.swap_out(group) is None:
            assert self.snapshot() == before, "a refused swap-out left state behind"
            assert self.recorded() == (0, 0)
            return
        self.swapped.update(group)
        self.run_step([])

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        group = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), min_size=1,
                                   unique=True), "group")
        before = self.snapshot()
        if self.mgr.swap_in(group) is None:
            assert self.snapshot() == before, "a refused swap-in left state behind"
            assert self.recorded() == (0, 0)
            return
        self.swapped.difference_update(group)
        self.run_step([])

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def manager_invariants(self) -> None:
        self.mgr.check_invariants()

    @invariant()
    def every_slot_holds_its_sequence_state(self) -> None:
        for seq_id, s in self.seqs.items():
            if seq_id in self.swapped:
                continue
            got = self.device.get(self.slot(seq_id))
            assert got == self.state_of(s, s.num_computed_tokens), (
                f"seq {seq_id}'s slot holds {got}")

    @invariant()
    def stats_count_the_slots(self) -> None:
        st_ = self.mgr.stats()
        running = {self.slot(s) for s in self.running()}
        assert st_["state_slots_used"] == len(running)
        assert st_["state_slots_total"] == NUM_SLOTS
        assert st_["state_cpu_slots_used"] <= NUM_CPU_SLOTS
        assert st_["prefix_cache_hit_tokens"] == self.hits

    def teardown(self) -> None:
        for s in list(self.seqs):
            self.mgr.free(s)
        self.mgr.check_invariants()
        st_ = self.mgr.stats()
        assert st_["state_slots_used"] == st_["state_cpu_slots_used"] == 0, "a state slot leaked"
        assert self.mgr.state.pool.num_free_blocks == NUM_SLOTS
        assert self.mgr.num_free_blocks() == NUM_BLOCKS


class SlidingStateSlotsMachine(StateSlotsMachine):
    """A full-attention group (the snapshots' anchor) beside a sliding one: a hit shortened to
    a snapshot is looked up again for the sliding group's window."""

    windows = (None, 6)


_settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestStateSlotsMachine = StateSlotsMachine.TestCase
TestStateSlotsMachine.settings = _settings
TestSlidingStateSlotsMachine = SlidingStateSlotsMachine.TestCase
TestSlidingStateSlotsMachine.settings = _settings
