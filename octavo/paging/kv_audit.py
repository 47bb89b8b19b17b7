"""What KVCacheManager holds, reported and checked: its stats (waste.py's slot accounting) and
its invariants (ref counts match the block tables, fill counts match the computed tokens,
cached blocks sit at their hash's position).
"""

from __future__ import annotations

from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.seq_blocks import SeqBlocks, cdiv
from octavo.paging.waste import check_slot_sum, paged_slot_stats


class KVAudit:
    """KVCacheManager's stats and invariants (a mixin: the manager owns the state)."""

    block_size: int
    windows: tuple[int | None, ...]
    block_pool: BlockPool
    cpu_pool: BlockPool
    num_blocks: int
    num_groups: int
    enable_prefix_caching: bool
    blocks_freed_out_of_window: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    _has_window: bool
    _seqs: dict[int, SeqBlocks]

    def sliding_blocks_held(self) -> int:
        """The most blocks any running sequence holds in one sliding-window group (0 without
        sliding groups): what the window bounds, about window/block_size + 1."""
        held = [len(s.blocks[g]) - s.trimmed[g]  # every entry from the trim mark on is held
                for s in self._seqs.values() if not s.swapped
                for g, w in enumerate(self.windows) if w is not None]
        return max(held, default=0)

    def _out_of_window_slots(self) -> int:
        """Filled slots of held sliding-window blocks that no query to come sees (the old end
        of a block straddling the window's start; also blocks not yet trimmed): waste. A slot
        of a shared block is dead only when it is dead for every sequence holding it."""
        if not self._has_window:
            return 0
        dead: dict[int, list[int]] = {}
        blocks: dict[int, KVBlock] = {}
        for state in self._seqs.values():
            if state.swapped:
                continue
            computed = state.seq.num_computed_tokens
            for g, window in enumerate(self.windows):
                if window is None:
                    continue
                start = max(0, computed - window + 1)  # the first position still seen
                for i in range(state.trimmed[g], cdiv(start, self.block_size)):
                    blk = state.blocks[g][i]
                    if blk is not None:
                        blocks[blk.block_id] = blk
                        dead.setdefault(blk.block_id, []).append(
                            min(blk.num_filled, start - i * self.block_size))
        # a holder missing from the list reads the whole block
        return sum(min(counts) for bid, counts in dead.items()
                   if len(counts) == blocks[bid].ref_cnt)

    def stats(self) -> dict[str, int | float]:
        pool = self.block_pool
        # every entry from a table's trim mark on holds a block
        table_entries = sum(len(table) - mark for s in self._seqs.values() if not s.swapped
                            for table, mark in zip(s.blocks, s.trimmed, strict=True))
        dead = self._out_of_window_slots()
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_blocks_cached_free": pool.num_cached_free_blocks,
            **paged_slot_stats(
                block_size=self.block_size,
                num_used_blocks=pool.num_used_blocks,
                num_free_blocks=pool.num_free_blocks,
                live_slots=pool.num_live_slots - dead,
            ),
            "kv_slots_out_of_window": dead,
            "kv_blocks_saved_by_sharing": table_entries - pool.num_used_blocks,
            "kv_cache_groups": self.num_groups,
            "kv_blocks_freed_out_of_window": self.blocks_freed_out_of_window,
            "kv_sliding_blocks_held_max": self.sliding_blocks_held(),
            "prefix_cache_query_tokens": self.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "peak_kv_blocks_used": pool.peak_used_blocks,
            "kv_cpu_blocks_total": self.cpu_pool.num_blocks,
            "kv_cpu_blocks_used": self.cpu_pool.num_used_blocks,
        }

    def check_invariants(self) -> None:
        bs = self.block_size
        self.block_pool.check_invariants(states=False)  # checked last, below
        self.cpu_pool.check_invariants(states=False)
        refs = {False: [0] * self.num_blocks, True: [0] * self.cpu_pool.num_blocks}
        for seq_id, state in self._seqs.items():
            seq = state.seq
            computed = seq.num_computed_tokens
            assert seq.seq_id == seq_id, f"seq {seq_id} is filed under another id"
            assert computed <= len(seq.token_ids), f"seq {seq_id}: computed unknown tokens"
            assert len(state.blocks) == len(state.chain_keys) == self.num_groups, (
                f"seq {seq_id}: {len(state.blocks)} block tables for {self.num_groups} groups")
            n_full = computed // bs if self.enable_prefix_caching else 0
            for g, (table, keys) in enumerate(zip(state.blocks, state.chain_keys, strict=True)):
                where = f"seq {seq_id} group {g}"
                assert len(table) == cdiv(computed + state.lookahead, bs), (
                    f"{where}: {len(table)} blocks for {computed} tokens and "
                    f"{state.lookahead} lookahead slots (paging reserves nothing ahead)")
                live = [blk for blk in table if blk is not None]
                assert len({id(b) for b in live}) == len(live), (
                    f"{where}: a block appears twice in one block table")
                dead = self._first_live(g, computed)
                for i, blk in enumerate(table):
                    if blk is None:
                        assert i < dead, f"{where}: block {i} freed but still in the window"
                        continue
                    assert i >= state.trimmed[g], f"{where}: block {i} below the trim mark"
                assert len(keys) == n_full, (
                    f"{where}: {len(keys)} registered blocks of {n_full} full ones")
                for i, blk in enumerate(table):
                    if blk is None:
                        continue
                    refs[state.swapped][blk.block_id] += 1
                    expect = max(0, min(bs, computed - i * bs))
                    assert blk.num_filled == expect, (
                        f"{where} block {blk.block_id}: {blk.num_filled} slots filled, "
                        f"expected {expect}")
                    if blk.block_hash is not None and not state.swapped:
                        assert i < n_full and blk.block_hash == self._key(
                            seq.block_hashes[i], g), (
                            f"{where} block {blk.block_id}: cached under another position's "
                            "hash")
        for swapped, pool in ((False, self.block_pool), (True, self.cpu_pool)):
            for blk in pool.blocks:
                assert blk.ref_cnt == refs[swapped][blk.block_id], (
                    f"{'CPU' if swapped else 'GPU'} block {blk.block_id}: ref count "
                    f"{blk.ref_cnt} but held by {refs[swapped][blk.block_id]} block tables"
                )
        self.block_pool.check_states()
        self.cpu_pool.check_states()
        check_slot_sum(self.stats(), self.num_blocks * bs)
