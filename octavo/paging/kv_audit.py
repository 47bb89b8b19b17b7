"""What a KV cache manager holds, reported and checked: its stats (waste.py's slot accounting)
and its invariants (ref counts match the block tables, fill counts match the computed tokens,
cached blocks sit at their hash's position). Functions over the manager's public state
(`KVState`), so they need nothing of its implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.group_windows import GroupWindows
from octavo.paging.prefix_cache import PrefixCache
from octavo.paging.seq_blocks import SeqBlocks, cdiv
from octavo.paging.tier.kv_tier import KVTier
from octavo.paging.waste import check_slot_sum, paged_slot_stats


class KVState(Protocol):
    num_blocks: int
    block_size: int
    groups: GroupWindows
    block_pool: BlockPool
    prefix_cache: PrefixCache
    blocks_freed_out_of_window: int
    tier: KVTier | None

    @property
    def cpu_pool(self) -> BlockPool: ...

    @property
    def seqs(self) -> Mapping[int, SeqBlocks]: ...


def sliding_blocks_held(kv: KVState) -> int:
    """The most blocks any running sequence holds in one sliding-window group (0 without
    sliding groups): what the window bounds, about window/block_size + 1."""
    held = [len(s.blocks[g]) - s.trimmed[g]  # every entry from the trim mark on is held
            for s in kv.seqs.values() if not s.swapped
            for g, w in enumerate(kv.groups.windows) if w is not None]
    return max(held, default=0)


def out_of_window_slots(kv: KVState) -> int:
    """Filled slots of held sliding-window blocks that no query to come sees (the old end of a
    block straddling the window's start; also blocks not yet trimmed): waste. A slot of a
    shared block is dead only when it is dead for every sequence holding it."""
    if not kv.groups.has_window:
        return 0
    dead: dict[int, list[int]] = {}
    blocks: dict[int, KVBlock] = {}
    for state in kv.seqs.values():
        if state.swapped:
            continue
        computed = state.seq.num_computed_tokens
        for g, window in enumerate(kv.groups.windows):
            if window is None:
                continue
            start = max(0, computed - window + 1)  # the first position still seen
            for i in range(state.trimmed[g], cdiv(start, kv.block_size)):
                blk = state.blocks[g][i]
                if blk is not None:
                    blocks[blk.block_id] = blk
                    dead.setdefault(blk.block_id, []).append(
                        min(blk.num_filled, start - i * kv.block_size))
    # a holder missing from the list reads the whole block
    return sum(min(counts) for bid, counts in dead.items()
               if len(counts) == blocks[bid].ref_cnt)


def kv_stats(kv: KVState) -> dict[str, int | float]:
    pool = kv.block_pool
    # every entry from a table's trim mark on holds a block
    table_entries = sum(len(table) - mark for s in kv.seqs.values() if not s.swapped
                        for table, mark in zip(s.blocks, s.trimmed, strict=True))
    dead = out_of_window_slots(kv)
    return {
        "kv_blocks_total": kv.num_blocks,
        "kv_blocks_used": pool.num_used_blocks,
        "kv_blocks_cached_free": pool.num_cached_free_blocks,
        **paged_slot_stats(
            block_size=kv.block_size,
            num_used_blocks=pool.num_used_blocks,
            num_free_blocks=pool.num_free_blocks,
            live_slots=pool.num_live_slots - dead,
        ),
        "kv_slots_out_of_window": dead,
        "kv_blocks_saved_by_sharing": table_entries - pool.num_used_blocks,
        "kv_cache_groups": kv.groups.num_groups,
        "kv_blocks_freed_out_of_window": kv.blocks_freed_out_of_window,
        "kv_sliding_blocks_held_max": sliding_blocks_held(kv),
        "prefix_cache_query_tokens": kv.prefix_cache.query_tokens,
        "prefix_cache_hit_tokens": kv.prefix_cache.hit_tokens,
        "peak_kv_blocks_used": pool.peak_used_blocks,
        "kv_cpu_blocks_total": kv.cpu_pool.num_blocks,
        "kv_cpu_blocks_used": kv.cpu_pool.num_used_blocks,
        **(kv.tier.stats() if kv.tier is not None else {}),
    }


def check_invariants(kv: KVState) -> None:
    bs, groups = kv.block_size, kv.groups
    kv.block_pool.check_invariants(states=False)  # checked last, below
    kv.cpu_pool.check_invariants(states=False)
    refs = {False: [0] * kv.num_blocks, True: [0] * kv.cpu_pool.num_blocks}
    for seq_id, state in kv.seqs.items():
        seq = state.seq
        computed = seq.num_computed_tokens
        assert seq.seq_id == seq_id, f"seq {seq_id} is filed under another id"
        assert computed <= len(seq.token_ids), f"seq {seq_id}: computed unknown tokens"
        assert len(state.blocks) == len(state.chain_keys) == groups.num_groups, (
            f"seq {seq_id}: {len(state.blocks)} block tables for {groups.num_groups} groups")
        n_full = computed // bs if kv.prefix_cache.enabled else 0
        for g, (table, keys) in enumerate(zip(state.blocks, state.chain_keys, strict=True)):
            where = f"seq {seq_id} group {g}"
            assert len(table) == cdiv(computed + state.lookahead, bs), (
                f"{where}: {len(table)} blocks for {computed} tokens and "
                f"{state.lookahead} lookahead slots (paging reserves nothing ahead)")
            live = [blk for blk in table if blk is not None]
            assert len({id(b) for b in live}) == len(live), (
                f"{where}: a block appears twice in one block table")
            dead = groups.first_live(g, computed)
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
                    assert i < n_full and blk.block_hash == kv.prefix_cache.key(
                        seq.block_hashes[i], g), (
                        f"{where} block {blk.block_id}: cached under another position's hash")
    for swapped, pool in ((False, kv.block_pool), (True, kv.cpu_pool)):
        for blk in pool.blocks:
            assert blk.ref_cnt == refs[swapped][blk.block_id], (
                f"{'CPU' if swapped else 'GPU'} block {blk.block_id}: ref count "
                f"{blk.ref_cnt} but held by {refs[swapped][blk.block_id]} block tables"
            )
    kv.block_pool.check_states()
    kv.cpu_pool.check_states()
    check_slot_sum(kv_stats(kv), kv.num_blocks * bs)
