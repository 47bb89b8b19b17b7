"""What the KV cache manager does with a sequence's block tables as a whole, once allocation
has started them: share them with a fork (copy-on-write), give them back, forget the cache
entries of blocks that were never computed, move them to host blocks and back (swap), read them.

KVTables is a part of KVCacheManager (kv_manager.py), which inherits it and holds the tables:
one SeqBlocks (seq_blocks.py) per sequence. The host blocks are the swap space's
(swap_space.py); with recurrent layers, a sequence's state slot follows its tables
(state_slots.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.kv_seq import KVSeq
from octavo.paging.seq_blocks import SeqBlocks
from octavo.paging.state_slots import StateSlots
from octavo.paging.swap_space import SwapSpace
from octavo.paging.tier.kv_tier import KVTier


class KVTables:
    """Fork, free, swap and read whole block tables (KVCacheManager's allocation starts and
    grows them). A swap first frees what left the sliding windows (the manager's
    free_out_of_window); freeing cancels the sequence's pending tier loads (KVTierIO's)."""

    # the manager's state (KVCacheManager.__init__; cpu_pool is its swap space's pool)
    block_size: int
    null_block_id: int
    block_pool: BlockPool
    cpu_pool: BlockPool
    swap_space: SwapSpace
    state: StateSlots | None
    tier: KVTier | None
    _seqs: dict[int, SeqBlocks]

    # -- fork and free --------------------------------------------------------------------------
    def fork(self, parent_id: int, child: KVSeq) -> None:
        """The child shares all of the parent's blocks; the first write into a shared block
        copies it (see allocate_slots). The child arrives with the parent's tokens, block
        hashes and computed-token count."""
        parent = self._on_gpu(parent_id)
        if parent.lookahead:
            raise ValueError(f"sequence {parent_id} holds lookahead slots: accept them first")
        if child.seq_id in self._seqs:
            raise ValueError(f"sequence {child.seq_id} already has KV blocks")
        if child.num_computed_tokens != parent.seq.num_computed_tokens:
            raise ValueError(
                f"fork of {parent_id}: the child counts {child.num_computed_tokens} computed "
                f"tokens, the parent {parent.seq.num_computed_tokens}"
            )
        for table in parent.blocks:
            for blk in table:
                if blk is not None:
                    self.block_pool.touch(blk)
        state = SeqBlocks(child, [list(t) for t in parent.blocks],
                          [list(k) for k in parent.chain_keys], trimmed=list(parent.trimmed))
        if self.state is not None:
            self.state.fork(parent, state)
        self._seqs[child.seq_id] = state

    def free(self, seq_id: int) -> None:
        """Drop a sequence in any state; its computed-token count goes back to 0. Unknown ids are
        ignored: a request aborted while waiting never had blocks. The tail is queued first so
        the shareable prefix is evicted last."""
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        if self.tier is not None and not state.swapped:
            self._cancel_loads(state)
        pool = self.cpu_pool if state.swapped else self.block_pool
        for table in state.blocks:
            pool.free(blk for blk in reversed(table) if blk is not None)
        if self.state is not None:
            self.state.free(state)
        state.seq.num_computed_tokens = 0

    def uncache_from(self, seq_id: int, num_tokens: int) -> None:
        """Forget the prefix-cache entries of this sequence's blocks holding tokens at or after
        `num_tokens`: they were registered when their slots were handed out, and the step that
        was to compute them failed, so nobody may hit them. Call before freeing the sequence."""
        state = self._seqs.get(seq_id)
        if state is None or state.swapped:
            return
        keep = num_tokens // self.block_size
        for table, keys in zip(state.blocks, state.chain_keys, strict=True):
            for blk in table[keep:]:
                if blk is not None and blk.ref_cnt == 1:  # shared: computed by someone else
                    self.block_pool.uncache(blk)
            del keys[keep:]
        if self.state is not None:
            self.state.drop_pending(state)

    # -- swap -----------------------------------------------------------------------------------
    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Move a group of sequences to host blocks and return the (device block, host block)
        copies, or None (nothing moves) when the host pool is too small. A block shared inside
        the group is copied once and stays shared; its device copy stays prefix-cached."""
        states = self._group(seq_ids, swapped=False)
        for state in states:
            if state.lookahead:
                raise ValueError(f"sequence {state.seq.seq_id} holds lookahead slots: accept "
                                 "them first")
        for state in states:
            self.free_out_of_window(state.seq.seq_id)  # nothing to carry that nobody reads
        if self.state is not None and not self.state.can_swap(states, out=True):
            return None
        copies = self.swap_space.swap_out(states)
        if copies is not None and self.state is not None:
            self.state.swap(states, out=True)
        return copies

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Bring a swapped group back and return the (host block, device block) copies, or
        None (nothing moves) when the free device blocks do not suffice."""
        states = self._group(seq_ids, swapped=True)
        if self.state is not None and not self.state.can_swap(states, out=False):
            return None
        copies = self.swap_space.swap_in(states)
        if copies is not None and self.state is not None:
            self.state.swap(states, out=False)
        return copies

    # -- queries --------------------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        """Group 0's block table (freed out-of-window entries read the null block)."""
        return self.block_tables(seq_id)[0]

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """Every group's table; with recurrent layers the state group's last: [its slot]."""
        null = self.null_block_id
        state = self._on_gpu(seq_id)
        tables = [[null if blk is None else blk.block_id for blk in table]
                  for table in state.blocks]
        if self.state is not None:
            assert state.state is not None
            tables.append([state.state.block_id])
        return tables

    def held_tables(self, seq_id: int) -> tuple[bool, list[list[int]]] | None:
        """(swapped, block tables) of a sequence holding blocks, else None: device block ids,
        or host block ids while swapped out; a freed out-of-window entry reads -1."""
        state = self._seqs.get(seq_id)
        if state is None:
            return None
        return state.swapped, [[-1 if blk is None else blk.block_id for blk in table]
                               for table in state.blocks]

    def tail_blocks(self) -> Iterator[tuple[bool, KVBlock]]:
        """(swapped, block) for every block a sequence holds past its last full one: the only
        blocks in use that can be partly filled."""
        bs = self.block_size
        for state in self._seqs.values():
            first = state.seq.num_computed_tokens // bs
            for table in state.blocks:
                for blk in table[first:]:
                    if blk is not None:
                        yield state.swapped, blk

    # -- helpers --------------------------------------------------------------------------------
    def _get(self, seq_id: int) -> SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no KV blocks") from None

    def _on_gpu(self, seq_id: int) -> SeqBlocks:
        state = self._get(seq_id)
        if state.swapped:
            raise ValueError(f"sequence {seq_id} is swapped out; swap it in first")
        return state

    def _group(self, seq_ids: Sequence[int], *, swapped: bool) -> list[SeqBlocks]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in {list(seq_ids)}")
        states = [self._get(s) for s in seq_ids]
        for seq_id, state in zip(seq_ids, states, strict=True):
            if state.swapped != swapped:
                what = "already swapped out" if state.swapped else "not swapped out"
                raise ValueError(f"sequence {seq_id} is {what}")
        return states
