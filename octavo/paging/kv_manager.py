"""Block tables on top of a BlockPool: allocate slots, fork (copy-on-write), free, swap.

KVCacheManager holds every sequence's block tables and owns the parts it calls through their
public methods: the prefix cache (prefix_cache.py), the swap space (swap_space.py), the
groups' window geometry (group_windows.py) and, where there is one, the KV tier below the
pool (tier/kv_tier.py); its stats and invariants are functions over its public state
(kv_audit.py).

The scheduler's side of the contract, on vLLM v1's lines: `get_computed_blocks(seq)` finds a
new sequence's cached prefix (a pure query), then one `allocate_slots(seq, n, cached)` either
gives `n` more tokens their slots and returns the block ids that changed, or returns None and
changes nothing. There is no separate "can I?" question to go stale before the "do it".

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

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

from octavo.paging.allocator import CachedPrefix, NewBlocks
from octavo.paging.block_pool import BlockPool, KVBlock, OutOfKVBlocks
from octavo.paging.group_windows import GroupWindows
from octavo.paging.kv_audit import check_invariants, kv_stats
from octavo.paging.kv_seq import KVSeq
from octavo.paging.prefix_cache import PrefixCache
from octavo.paging.seq_blocks import SeqBlocks, cdiv
from octavo.paging.swap_space import SwapSpace
from octavo.paging.tier.kv_tier import KVTier, TierBlock

__all__ = ["KVCacheManager", "OutOfKVBlocks"]


class KVCacheManager:
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
        self._seqs: dict[int, SeqBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.blocks_freed_out_of_window = 0
        self.tier = tier if enable_prefix_caching else None
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
        references taken, no stats counted."""
        return self.prefix_cache.lookup(seq)

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

    def _new_blocks(self, state: SeqBlocks, starts: list[int]) -> NewBlocks:
        null = self.null_block_id
        tables = [(start, [null if blk is None else blk.block_id for blk in table[start:]])
                  for start, table in zip(starts, state.blocks, strict=True)]
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
        seq.num_computed_tokens = num_cached
        self._fill(state, end)
        self.prefix_cache.register_full_blocks(state)
        if self.enable_prefix_caching and cached is not None:
            self.prefix_cache.count_hit(seq, num_cached)
        return self._new_blocks(state, [0] * self.num_groups)

    def _read_tier(self, seq: KVSeq, hits: list[list], from_tier: list[tuple[int, int]]
                   ) -> list[memoryview] | None:
        """The checked payloads of a prefix's tier blocks, in `from_tier`'s order, or None when
        one failed to load (the tier forgets it, so the next lookup stops before it)."""
        if not from_tier:
            return []
        assert self.tier is not None
        return self.tier.read([hits[g][i].key for g, i in from_tier],
                              [self.prefix_cache.block_tokens(seq, i) for _, i in from_tier])

    def _register_loaded(self, state: SeqBlocks, from_tier: list[tuple[int, int]],
                         payloads: list[memoryview]) -> None:
        """Index the fresh blocks a tier hit fills (in group order: a sliding group's blocks
        chain onto the anchor's) and queue their loads."""
        assert self.tier is not None
        cache, seq, bs = self.prefix_cache, state.seq, self.block_size
        loaded = dict(zip(from_tier, payloads, strict=True))
        for g in self.groups.order:
            for i, blk in enumerate(state.blocks[g]):
                payload = loaded.get((g, i))
                if payload is None:
                    continue
                assert blk is not None
                self.block_pool.set_filled(blk, bs)
                parent = cache.parent_key(state, g, i)
                if parent is None and self.groups.anchor is None:
                    # every group slides and this block opens the window: as for a pool hit
                    # there, its digest alone names the prefix before it
                    parent = 0
                state.chain_keys[g][i] = cache.record_full_block(
                    blk, cache.key(seq.block_hashes[i], g), cache.block_tokens(seq, i),
                    parent, seq)
                self.tier.add_load(blk.block_id, payload)
        self.tier.hit_tokens += len({i for _, i in from_tier}) * bs

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
        self._fill(state, end)
        state.lookahead = lookahead
        self.prefix_cache.register_full_blocks(state)
        return self._new_blocks(state, starts)

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
        self._seqs[child.seq_id] = SeqBlocks(child, [list(t) for t in parent.blocks],
                                        [list(k) for k in parent.chain_keys],
                                        trimmed=list(parent.trimmed))

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
        state.seq.num_computed_tokens = 0

    def _cancel_loads(self, state: SeqBlocks) -> None:
        """Blocks of a sequence freed before the step that was to load them from the tier ran:
        no load, and nobody may hit them (a sequence that hit them too keeps them loaded)."""
        assert self.tier is not None
        for table in state.blocks:
            for blk in table:
                if blk is not None and blk.ref_cnt == 1 and self.tier.has_pending_load(
                        blk.block_id):
                    self.tier.cancel_load(blk.block_id)
                    self.block_pool.uncache(blk)

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

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies (src, dst), handed over once."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- the KV tier ----------------------------------------------------------------------------
    def take_tier_io(self) -> tuple[list[int], list[tuple[int, memoryview]]]:
        """This plan's tier traffic, handed over once: the block ids whose bytes the runner
        copies out before anything else, and the (block id, payload) it writes in before the
        forward pass (tier/kv_tier.py)."""
        if self.tier is None:
            return [], []
        return self.tier.take_io()

    def tier_io_done(self, saved: Sequence[bytes]) -> None:
        """The step ran: the bytes the runner copied out, in the plan's order, go to the
        tier's writer."""
        if self.tier is not None:
            self.tier.io_done(saved)

    def tier_io_failed(self) -> None:
        """The step raised: the blocks it was to load hold unknown bytes, so nobody may hit
        them (the caller aborts the sequences holding them)."""
        if self.tier is None:
            return
        for block_id in self.tier.io_failed():
            self.block_pool.uncache(self.block_pool.blocks[block_id])

    def has_tier_saves(self) -> bool:
        """Blocks wait for a step to copy them out (an idle engine runs one for them)."""
        return self.tier is not None and self.tier.has_pending_saves


    # -- queries --------------------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        """Group 0's block table (freed out-of-window entries read the null block)."""
        return self.block_tables(seq_id)[0]

    def block_tables(self, seq_id: int) -> list[list[int]]:
        null = self.null_block_id
        return [[null if blk is None else blk.block_id for blk in table]
                for table in self._on_gpu(seq_id).blocks]

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

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.num_used_blocks / self.num_blocks

    def stats(self) -> dict[str, int | float]:
        return kv_stats(self)

    def check_invariants(self) -> None:
        check_invariants(self)

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
        return self.swap_space.swap_out(states)

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Bring a swapped group back and return the (host block, device block) copies, or
        None (nothing moves) when the free device blocks do not suffice."""
        return self.swap_space.swap_in(self._group(seq_ids, swapped=True))

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
