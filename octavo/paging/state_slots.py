"""Recurrent state as a paged resource: the state-slot pool beside the KV block pool.

A recurrent layer (Gated DeltaNet, Mamba-2) keeps one fixed-size state per sequence however long
the sequence: the states of all of a model's recurrent layers for one sequence make one *state
slot*. The slots form a pool of their own (a BlockPool: ref counts, free queues, a hash index,
LRU eviction), and the KV manager hands them out through the allocate_slots contract, as one
more KV cache group whose block table is the sequence's one slot:

- a sequence's first allocate_slots takes a slot (or returns None, like a block shortage);
- fork shares the slot (its ref count), and the first write after the fork copies it
  (copy-on-write, as for a shared partial KV block): n > 1 samples and beams each start from
  the parent's state at the cost of one copy;
- prefix caching: a state can only be found at a position where it was saved. A chunk that
  crosses a block boundary therefore takes a *snapshot*: the runner writes the state at the
  last block boundary inside the chunk into a fresh slot, mid-chunk (a prompt's last boundary
  before its last token is what a later request with the same prompt can hit). Once the step
  ran (`commit`) the snapshot is registered under that block's hash, chained onto the
  full-attention group's block there, whose chain vouches for the whole prefix. Registered
  snapshots wait in the pool's cached-free queue: they count as free, any allocation may evict
  the least recently saved, and stats() counts them. A prefix hit is the longest cached KV
  prefix that ends at a snapshot; the snapshot is copied into the new sequence's slot and the
  rest of the prompt is computed from there;
- preemption: swap moves the slot to the host pool and back; recompute frees it (a later prefix
  hit restores a snapshot, else the state is computed again from the first token).

Every state transfer (copy, swap out, swap in) is recorded in order and the runner executes
them in that order before the forward pass: a slot that one transfer reads is never
overwritten first by another, even when it was freed and handed out again in the same step.
A slot handed to a sequence that starts at position 0 needs no clearing: the runner starts a
chunk at position 0 from the zero state.
"""

from __future__ import annotations

from collections.abc import Callable

from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.kv_seq import KVSeq
from octavo.paging.seq_blocks import SeqBlocks

# (kind, source slot, destination slot), kind "copy" (device to device), "out" (device to
# host) or "in" (host to device)
StateTransfer = tuple[str, int, int]
# (sequence id, position, slot): write the sequence's state after `position` tokens (a block
# boundary inside the step's chunk) into `slot`
StateSnapshot = tuple[int, int, int]


class StateSlots:
    def __init__(self, num_slots: int, num_host_slots: int, block_size: int,
                 anchor: int | None, enable_caching: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1, got {num_slots}")
        self.pool = BlockPool(num_slots, enable_caching)
        self.host = BlockPool(num_host_slots, enable_caching=False)
        self.block_size = block_size
        # the full-attention group snapshots chain onto; without one (every group slides) no
        # chain vouches for a whole prefix, so nothing is saved or found
        self.anchor = anchor
        self.caching = enable_caching and anchor is not None
        self._transfers: list[StateTransfer] = []
        self._snapshots: list[StateSnapshot] = []
        self.snapshot_hits = 0
        self.snapshots_saved = 0

    # -- a sequence's slot -------------------------------------------------------------------
    def start(self, state: SeqBlocks, hit: KVBlock | None) -> None:
        """A new sequence's slot, the snapshot `hit` copied into it (None: from the start).
        The caller checked that a slot is free. The snapshot is not referenced: it is read by
        the first transfer recorded after this, before any later one can overwrite it."""
        slot = self.pool.get_new_block()
        if hit is not None:
            self._transfers.append(("copy", hit.block_id, slot.block_id))
            self.snapshot_hits += 1
        state.state = slot

    def needs_copy(self, state: SeqBlocks) -> bool:
        """Whether the sequence's next write must first copy its slot (shared after a fork)."""
        assert state.state is not None
        return state.state.ref_cnt > 1

    def write(self, state: SeqBlocks) -> bool:
        """The sequence computes tokens this step: copy its slot first if it is shared. Whether
        its slot changed. The caller checked that a slot is free where a copy is needed."""
        src = state.state
        assert src is not None
        if src.ref_cnt == 1:
            return False
        dst = self.pool.get_new_block()
        self._transfers.append(("copy", src.block_id, dst.block_id))
        self.pool.free([src])  # still held by the sequences it is shared with
        state.state = dst
        return True

    def fork(self, parent: SeqBlocks, child: SeqBlocks) -> None:
        assert parent.state is not None
        self.pool.touch(parent.state)
        child.state = parent.state

    def free(self, state: SeqBlocks) -> None:
        self.drop_pending(state)
        if state.state is not None:
            (self.host if state.swapped else self.pool).free([state.state])
            state.state = None

    # -- snapshots ----------------------------------------------------------------------------
    def snapshot(self, state: SeqBlocks, start: int, end: int,
                 find: Callable[[KVSeq, int], KVBlock | None]) -> None:
        """The step computes tokens [start, end): save the state at the last block boundary
        strictly inside, unless one is saved there already or no slot is free (snapshots
        never take a slot a sequence needs: an allocation that finds none fails first)."""
        if not self.caching:
            return
        bs = self.block_size
        boundary = (end - 1) // bs * bs
        if boundary <= start or not self.pool.num_free_blocks:
            return
        if find(state.seq, boundary // bs) is not None:
            return
        slot = self.pool.get_new_block()
        state.state_pending.append((boundary, slot))
        self._snapshots.append((state.seq.seq_id, boundary, slot.block_id))

    def commit(self, state: SeqBlocks, chain_key: Callable[[int], int | None],
               tokens: Callable[[int], tuple[int, ...]]) -> None:
        """The step ran: register its snapshots (the block before each boundary must itself be
        registered, `chain_key`, else nothing could vouch for the prefix) and let them go to
        the cached-free queue."""
        seq = state.seq
        for boundary, slot in state.state_pending:
            i = boundary // self.block_size - 1
            key = chain_key(i)
            if key is not None and self.pool.cache_full_block(
                    slot, seq.block_hashes[i], tokens(i), key, seq.extra_key) == slot.cache_key:
                self.snapshots_saved += 1
            self.pool.free([slot])  # indexed: cached-free, else plain free
        state.state_pending.clear()

    def drop_pending(self, state: SeqBlocks) -> None:
        """Snapshots the step was to take, when it will not run (or did not)."""
        if not state.state_pending:
            return
        self.pool.free(slot for _, slot in state.state_pending)
        state.state_pending.clear()
        seq_id = state.seq.seq_id
        self._snapshots = [s for s in self._snapshots if s[0] != seq_id]

    def find(self, seq: KVSeq, num_blocks: int, parent_key: int) -> KVBlock | None:
        """The snapshot of `seq`'s first `num_blocks` blocks, whose last block in the anchor
        group has cache key `parent_key`, or None."""
        i = num_blocks - 1
        bs = self.block_size
        return self.pool.get_cached_block(seq.block_hashes[i],
                                          tuple(seq.token_ids[i * bs : (i + 1) * bs]),
                                          parent_key, seq.extra_key)

    def lookup(self, seq: KVSeq, anchor_hits: tuple[KVBlock | None, ...]) -> tuple[int, KVBlock
                                                                                | None]:
        """The longest prefix of the anchor group's hits that ends at a snapshot: (blocks,
        snapshot), (0, None) without one."""
        if not self.caching:
            return 0, None
        for n in range(len(anchor_hits), 0, -1):
            blk = anchor_hits[n - 1]
            hit = None if blk is None else self.find(seq, n, blk.cache_key)
            if hit is not None:
                return n, hit
        return 0, None

    # -- swap ---------------------------------------------------------------------------------
    def can_swap(self, states: list[SeqBlocks], out: bool) -> bool:
        """Whether the other pool has a free slot for every distinct slot of the group."""
        distinct = {s.state.block_id for s in states if s.state is not None}
        return len(distinct) <= (self.host if out else self.pool).num_free_blocks

    def swap(self, states: list[SeqBlocks], out: bool) -> None:
        """Move the group's slots to the host pool (out) or back; a slot shared inside the
        group moves once and stays shared. The caller checked can_swap."""
        src_pool, dst_pool = (self.pool, self.host) if out else (self.host, self.pool)
        placed: dict[int, KVBlock] = {}
        for state in states:
            self.drop_pending(state)
            src = state.state
            assert src is not None
            dst = placed.get(src.block_id)
            if dst is None:
                dst = placed[src.block_id] = dst_pool.get_new_block()
                self._transfers.append(("out" if out else "in", src.block_id, dst.block_id))
            else:
                dst_pool.touch(dst)
            src_pool.free([src])
            state.state = dst

    # -- the runner's side ---------------------------------------------------------------------
    def take(self) -> tuple[list[StateTransfer], list[StateSnapshot]]:
        """The transfers and snapshots recorded since the last call, handed over once."""
        out = (self._transfers, self._snapshots)
        self._transfers, self._snapshots = [], []
        return out

    # -- accounting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        pool = self.pool
        return {
            "state_slots_total": pool.num_blocks,
            "state_slots_used": pool.num_used_blocks,
            "state_snapshots_cached": pool.num_cached_blocks,
            "state_snapshots_saved": self.snapshots_saved,
            "state_snapshot_hits": self.snapshot_hits,
            "state_snapshots_evicted": pool.num_evictions,
            "state_cpu_slots_total": self.host.num_blocks,
            "state_cpu_slots_used": self.host.num_used_blocks,
        }

    def check_invariants(self, states: list[SeqBlocks]) -> None:
        """Ref counts equal the holders (sequences' slots, pending snapshots); working slots
        and pending snapshots are never indexed; indexed snapshots are held by nobody."""
        self.pool.check_invariants()
        self.host.check_invariants()
        refs = {False: [0] * self.pool.num_blocks, True: [0] * self.host.num_blocks}
        for s in states:
            seq_id = s.seq.seq_id
            assert s.state is not None, f"seq {seq_id} holds no state slot"
            assert s.state.block_hash is None, f"seq {seq_id}: its working slot is indexed"
            refs[s.swapped][s.state.block_id] += 1
            assert not (s.swapped and s.state_pending), f"seq {seq_id}: swapped with snapshots"
            for boundary, slot in s.state_pending:
                assert boundary % self.block_size == 0 and 0 < boundary <= (
                    s.seq.num_computed_tokens), f"seq {seq_id}: snapshot at {boundary}"
                assert slot.block_hash is None, f"seq {seq_id}: a pending snapshot is indexed"
                refs[False][slot.block_id] += 1
        for swapped, pool in ((False, self.pool), (True, self.host)):
            for blk in pool.blocks:
                assert blk.ref_cnt == refs[swapped][blk.block_id], (
                    f"{'host' if swapped else 'device'} state slot {blk.block_id}: ref "
                    f"{blk.ref_cnt}, held {refs[swapped][blk.block_id]} times")
                if blk.block_hash is not None:
                    assert blk.ref_cnt == 0, f"snapshot {blk.block_id} is held"
