"""Block tables on top of a BlockPool: allocate slots, fork (copy-on-write), free, swap.

KVCacheManager holds every sequence's block tables and owns the parts it calls through their
public methods: the prefix cache (prefix_cache.py), the swap space (swap_space.py), the
groups' window geometry (group_windows.py) and, where there is one, the KV tier below the
pool (tier/kv_tier.py); its stats and invariants are functions over its public state
(kv_audit.py). This module is its allocation; two parts of the class have modules of their
own, which it inherits: what is done with a sequence's tables as a whole once they exist
(fork, free, swap, read them: kv_tables.py) and its side of the KV tier (kv_tier_io.py).

The scheduler's side of the contract, on vLLM v1's lines: `get_computed_blocks(seq)` finds a
new sequence's cached prefix (a pure query), then one `allocate_slots(seq, n, cached)` either
gives `n` more tokens their slots and returns the block ids that changed, or returns None and
changes nothing. There is no separate "can I?" question to go stale before the "do it".

A model with recurrent layers also gets a state slot per sequence from a pool beside the block
pool (state_slots.py): one more KV cache group, last, whose table is that one slot. Its
transfers and snapshots are taken with `take_state_ops`, and `commit_step` after each step
makes the step's snapshots findable.

Slots are counted as computed when handed out (`seq.num_computed_tokens` moves here and only
here), because the runner writes them in the same step. Copies are only recorded; the runner
moves the KV tensors: the KV tier's saves first (blocks let go of since the last step, whose
memory this step may reuse), then swap-out copies (their sources may be reused right after),
swap-in copies, the tier's loads (into fresh blocks) and copy-on-write copies, all before the
forward pass writes new KV. Blocks
registered in the prefix cache during a step can be hit by a sequence scheduled later in the
same step, so the runner must write all of a step's new KV before attention reads it (a
flattened batch does this per layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from octavo.paging.allocator import CachedPrefix, NewBlocks
from octavo.paging.block_pool import BlockPool, KVBlock, OutOfKVBlocks
from octavo.paging.group_windows import GroupWindows
from octavo.paging.kv_audit import check_invariants, kv_stats
from octavo.paging.kv_seq import KVSeq
from octavo.paging.kv_tables import KVTables
from octavo.paging.kv_tier_io import KVTierIO
from octavo.paging.prefix_cache import PrefixCache
from octavo.paging.seq_blocks import SeqBlocks, cdiv
from octavo.paging.state_slots import StateSlots
from octavo.paging.swap_space import SwapSpace
from octavo.paging.tier.kv_tier import KVTier, TierBlock

__all__ = ["KVCacheManager", "OutOfKVBlocks"]


class KVCacheManager(KVTables, KVTierIO):
    """Paged KV cache: per-sequence block tables over shared, ref-counted physical blocks.

    With prefix caching on, every block that fills is registered under its sequence's block
    hash (see block_hash.py and prefix_cache.py).

    `windows` names the KV cache groups (see KVGroups in octavo/config.py): one entry per
    group, its sliding window or None for full attention. A sliding group frees every block
    that lies wholly before the window of its next query, so a sequence holds at most about
    window/block_size + 1 blocks there however long it gets; the freed entries read None (the
    runner's null block). All groups draw on one pool; every group's table covers the same
    tokens.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        windows: Sequence[int | None] = (None,),
        tier: KVTier | None = None,
        num_state_slots: int = 0,
        num_cpu_state_slots: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = GroupWindows(windows, block_size)
        self.windows = self.groups.windows
        self.num_groups = self.groups.num_groups
        # the block id that stands for a freed out-of-window block (see KVCache)
        self.null_block_id = num_blocks
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_cache = PrefixCache(self.block_pool, self.groups, enable_prefix_caching)
        self.swap_space = SwapSpace(num_cpu_blocks, self.block_pool, self.prefix_cache,
                                    self.groups)
        # recurrent layers' states (None: a model without them)
        self.state = (StateSlots(num_state_slots, num_cpu_state_slots, block_size,
                                 self.groups.anchor, enable_prefix_caching)
                      if num_state_slots else None)
        self._seqs: dict[int, SeqBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.blocks_freed_out_of_window = 0
        self.tier = tier if enable_prefix_caching else None
        if self.tier is not None and self.state is not None:
            raise ValueError("the KV tier holds no recurrent state snapshots: a model with "
                             "recurrent layers runs without kv_offload_dir/kv_offload_url")
        if self.tier is not None:
            self.prefix_cache.tier = self.tier
            self.block_pool.tier_offer = self.tier.offer
            self.block_pool.offer_on_evict = self.tier.write == "evict"

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache.enabled

    @property
    def cpu_pool(self) -> BlockPool:
        return self.swap_space.pool

    @property
    def seqs(self) -> Mapping[int, SeqBlocks]:
        """Every sequence holding blocks, read-only."""
        return MappingProxyType(self._seqs)

    # -- windows --------------------------------------------------------------------------------
    def _trim(self, state: SeqBlocks) -> int:
        """Free the sliding groups' blocks that no query to come can see."""
        freed = 0
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            first = self.groups.first_live(g, state.seq.num_computed_tokens)
            table = state.blocks[g]
            gone = [blk for blk in table[state.trimmed[g] : first] if blk is not None]
            for i in range(state.trimmed[g], first):
                table[i] = None
            state.trimmed[g] = max(state.trimmed[g], first)
            if gone:
                self.block_pool.free(reversed(gone))
                freed += len(gone)
        self.blocks_freed_out_of_window += freed
        return freed

    def free_out_of_window(self, seq_id: int) -> int:
        """Return the blocks of a running sequence that fell out of its sliding windows (the
        scheduler calls this after each step; allocation does it too). The number freed."""
        if not self.groups.has_window:
            return 0
        state = self._seqs.get(seq_id)
        if state is None or state.swapped:
            return 0
        return self._trim(state)

    # -- prefix cache ---------------------------------------------------------------------------
    def get_computed_blocks(self, seq: KVSeq) -> CachedPrefix:
        """A new sequence's cached prefix (prefix_cache.py's lookup): a pure query, no
        references taken, no stats counted. With recurrent layers it ends where a state
        snapshot was saved, and carries it."""
        cached = self.prefix_cache.lookup(seq)
        if self.state is None or not cached.num_tokens:
            return cached
        anchor = self.groups.anchor
        while cached.num_tokens:
            n, snapshot = self.state.lookup(seq, cached.blocks[anchor] if anchor is not None
                                            else ())
            if n == len(cached.blocks[0]):
                return replace(cached, state=snapshot)
            # shorter: a sliding group may need other blocks for it, so look it up again
            cached = self.prefix_cache.lookup(seq, max_blocks=n)
        return cached

    # -- allocation -----------------------------------------------------------------------------
    def allocate_slots(
        self,
        seq: KVSeq,
        num_new_tokens: int,
        cached: CachedPrefix | None = None,
        *,
        num_lookahead_tokens: int = 0,
    ) -> NewBlocks | None:
        """Give the next `num_new_tokens` known tokens of `seq` their slots, or return None (and
        change nothing the caller can see) when the free blocks do not suffice.

        `num_lookahead_tokens` more slots after them hold draft tokens a speculative step
        verifies (a started sequence only): their blocks are handed out, but they count as
        neither computed nor filled, and nothing is cached for them, until accept_lookahead
        keeps the accepted ones and gives the rest back.

        A sequence's first call starts its block tables: `cached` (from get_computed_blocks,
        None to compute everything, as prompt logprobs need) is reused and `num_new_tokens`
        counts from its end. Later calls first free the blocks that left a sliding window, then
        grow the tables, copying a shared partial last block first (copy-on-write). Returns
        each block table from its first entry that changed (entries freed out of a window are
        not reported: nothing reads them again). Paging reserves nothing ahead.
        """
        state = self._seqs.get(seq.seq_id)
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        if num_lookahead_tokens and self.state is not None:
            raise ValueError("lookahead slots (speculative decoding) cannot hold a recurrent "
                             "state: a model with recurrent layers does not speculate")
        if state is None:
            if num_lookahead_tokens:
                raise ValueError(f"sequence {seq.seq_id}: lookahead slots need KV blocks "
                                 "already (a sequence that decodes)")
            return self._start(seq, num_new_tokens, cached)
        if state.lookahead:
            raise ValueError(f"sequence {seq.seq_id} still holds {state.lookahead} lookahead "
                             "slots: accept_lookahead first")
        if state.seq is not seq:
            raise ValueError(f"sequence id {seq.seq_id} already has KV blocks")
        if cached is not None:
            raise ValueError(f"sequence {seq.seq_id} already has blocks: no cached prefix to add")
        if state.swapped:
            raise ValueError(f"sequence {seq.seq_id} is swapped out; swap it in first")
        return self._grow(state, num_new_tokens, num_lookahead_tokens)

    def accept_lookahead(self, seq_id: int, num_accepted: int) -> None:
        """The verification of a speculative step kept the first `num_accepted` draft tokens,
        now appended to the sequence's tokens: their slots (written by that step) count as
        computed and full blocks are cached; the other lookahead slots go back, and with them
        every block past the computed tokens. A sequence freed meanwhile is ignored."""
        state = self._seqs.get(seq_id)
        if state is None:
            return
        seq = state.seq
        if not 0 <= num_accepted <= state.lookahead:
            raise ValueError(f"sequence {seq_id}: {num_accepted} accepted of "
                             f"{state.lookahead} lookahead slots")
        end = self._checked_end(seq, seq.num_computed_tokens, num_accepted)
        self.prefix_cache.check_hashes(seq, end)
        state.lookahead = 0
        self._fill(state, end)
        self.prefix_cache.register_full_blocks(state)
        keep = cdiv(end, self.block_size)
        for table in state.blocks:
            tail = table[keep:]
            del table[keep:]
            self.block_pool.free(blk for blk in reversed(tail) if blk is not None)

    def _new_blocks(self, state: SeqBlocks, starts: list[int],
                    state_changed: bool = False) -> NewBlocks:
        null = self.null_block_id
        tables = [(start, [null if blk is None else blk.block_id for blk in table[start:]])
                  for start, table in zip(starts, state.blocks, strict=True)]
        if self.state is not None:  # the state group: its one slot, when it changed
            assert state.state is not None
            tables.append((0, [state.state.block_id]) if state_changed else (1, []))
        return NewBlocks(*tables[0], other_groups=tuple(tables[1:]))

    def _start(
        self, seq: KVSeq, num_new_tokens: int, cached: CachedPrefix | None
    ) -> NewBlocks | None:
        if seq.num_computed_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} counts {seq.num_computed_tokens} computed tokens but "
                "has no KV blocks"
            )
        pool, bs, groups = self.block_pool, self.block_size, range(self.num_groups)
        while True:  # once more each time a tier block fails to load (none without a tier)
            if cached is not None and cached.num_tokens:
                if len(cached.blocks) != self.num_groups:
                    raise ValueError(f"a cached prefix of {len(cached.blocks)} groups for a KV "
                                     f"cache of {self.num_groups}")
                if self.state is not None and cached.state is None:
                    raise ValueError("a cached prefix without its state snapshot, for a model "
                                     "with recurrent layers (get_computed_blocks gives both)")
                hits = [list(blocks) for blocks in cached.blocks]
            else:
                hits = [[] for _ in groups]
            num_cached = len(hits[0]) * bs
            end = self._checked_end(seq, num_cached, num_new_tokens)
            self.prefix_cache.check_hashes(seq, end)
            live = [blk for group in hits for blk in group if isinstance(blk, KVBlock)]
            from_tier = [(g, i) for g in groups for i, blk in enumerate(hits[g])
                         if isinstance(blk, TierBlock)]
            # A hit on a cached-free block takes it off the free list; a hit on a used one is
            # free; a tier hit takes a fresh block, as computing the block would.
            fresh = cdiv(end, bs) - len(hits[0])
            if (sum(blk.ref_cnt == 0 for blk in live) + fresh * self.num_groups
                    + len(from_tier) > pool.num_free_blocks):
                return None
            if self.state is not None and not self.state.pool.num_free_blocks:
                return None
            payloads = self._read_tier(seq, hits, from_tier)
            if payloads is not None:
                break
            cached = self.prefix_cache.lookup(seq)  # without the block that failed
        for blk in live:  # before any get_new_block(), so no hit can be evicted under us
            pool.touch(blk)
        for g, i in from_tier:
            hits[g][i] = pool.get_new_block()
        blocks = [hits[g] + [pool.get_new_block() for _ in range(fresh)] for g in groups]
        chain_keys = [[None if blk is None else blk.cache_key for blk in hits[g]] for g in groups]
        trimmed = [next((i for i, b in enumerate(hits[g]) if b is not None), len(hits[g]))
                   for g in groups]
        state = SeqBlocks(seq, blocks, chain_keys, trimmed=trimmed)
        self._seqs[seq.seq_id] = state
        if from_tier:
            self._register_loaded(state, from_tier, payloads)
        if self.state is not None:
            self.state.start(state, cached.state if cached is not None and num_cached else None)
        seq.num_computed_tokens = num_cached
        self._fill(state, end)
        self.prefix_cache.register_full_blocks(state)
        self._snapshot(state, num_cached, end)
        if self.enable_prefix_caching and cached is not None:
            self.prefix_cache.count_hit(seq, num_cached)
        return self._new_blocks(state, [0] * self.num_groups, state_changed=True)


    def _grow(self, state: SeqBlocks, num_new_tokens: int, lookahead: int = 0) -> NewBlocks | None:
        seq, pool, bs = state.seq, self.block_pool, self.block_size
        end = self._checked_end(seq, seq.num_computed_tokens, num_new_tokens)
        self.prefix_cache.check_hashes(seq, end)
        if num_new_tokens == 0 and lookahead == 0:
            return self._new_blocks(state, [len(t) for t in state.blocks])
        if self.groups.has_window:
            self._trim(state)  # dead blocks: freeing them is right whatever happens next
        copies = [self._needs_copy_on_write(state, g) for g in range(self.num_groups)]
        grow = max(0, cdiv(end + lookahead, bs) - len(state.blocks[0]))
        if grow * self.num_groups + sum(copies) > pool.num_free_blocks:
            return None
        writes_state = self.state is not None and num_new_tokens > 0
        if writes_state and self.state.needs_copy(state) and not self.state.pool.num_free_blocks:
            return None
        start_pos = seq.num_computed_tokens
        starts = []
        for g, table in enumerate(state.blocks):
            start = len(table)
            if copies[g]:
                start = seq.num_computed_tokens // bs
                src = table[start]
                assert src is not None
                dst = pool.get_new_block()
                pool.set_filled(dst, src.num_filled)
                pool.free([src])  # still referenced by the sequences it is shared with
                table[start] = dst
                self._pending_copies.append((src.block_id, dst.block_id))
            for _ in range(grow):
                table.append(pool.get_new_block())
            starts.append(start)
        state_changed = writes_state and self.state.write(state)
        self._fill(state, end)
        state.lookahead = lookahead
        self.prefix_cache.register_full_blocks(state)
        if writes_state:
            self._snapshot(state, start_pos, end)
        return self._new_blocks(state, starts, state_changed)

    # -- recurrent state ------------------------------------------------------------------------
    def _snapshot(self, state: SeqBlocks, start: int, end: int) -> None:
        if self.state is None or self.groups.anchor is None:
            return
        keys = state.chain_keys[self.groups.anchor]

        def find(seq: KVSeq, num_blocks: int):
            key = keys[num_blocks - 1] if num_blocks <= len(keys) else None
            return None if key is None else self.state.find(seq, num_blocks, key)

        self.state.snapshot(state, start, end, find)

    def commit_step(self, seq_id: int) -> None:
        """The step that computed this sequence's chunk ran: the state snapshots it took can
        now be found (the scheduler calls this after every step, for every chunk)."""
        state = self._seqs.get(seq_id)
        if self.state is None or state is None or state.swapped or self.groups.anchor is None:
            return
        keys = state.chain_keys[self.groups.anchor]
        self.state.commit(state, lambda i: keys[i] if i < len(keys) else None,
                          lambda i: self.prefix_cache.block_tokens(state.seq, i))

    def take_state_ops(self) -> tuple[list[tuple[str, int, int]], list[tuple[int, int, int]]]:
        """The state transfers (in the order the runner must run them, before the forward
        pass) and snapshots recorded since the last call, handed over once."""
        return self.state.take() if self.state is not None else ([], [])

    def _checked_end(self, seq: KVSeq, start: int, num_new_tokens: int) -> int:
        end = start + num_new_tokens
        if num_new_tokens < 0 or end > len(seq.token_ids):
            raise ValueError(
                f"cannot compute {num_new_tokens} new tokens after {start} of "
                f"{len(seq.token_ids)} known tokens"
            )
        return end

    def _fill(self, state: SeqBlocks, end: int) -> None:
        bs = self.block_size
        for table in state.blocks:
            for i in range(state.seq.num_computed_tokens // bs, cdiv(end, bs)):
                blk = table[i]
                assert blk is not None
                self.block_pool.set_filled(blk, min(bs, end - i * bs))
        state.seq.num_computed_tokens = end

    def _needs_copy_on_write(self, state: SeqBlocks, group: int) -> bool:
        # The next slot is inside the last block; writing it must not change other sequences' KV.
        n = state.seq.num_computed_tokens
        if n % self.block_size == 0:
            return False
        blk = state.blocks[group][n // self.block_size]
        return blk is not None and blk.ref_cnt > 1

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies (src, dst), handed over once."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- queries --------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.num_used_blocks / self.num_blocks

    def stats(self) -> dict[str, int | float]:
        return kv_stats(self)

    def check_invariants(self) -> None:
        check_invariants(self)
