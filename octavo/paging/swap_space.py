"""Swap space: a host-memory pool that a group of sequences' blocks move to and back from.

The KV manager validates the group and calls `swap_out` / `swap_in` with the sequences' block
records; this records the copies (the runner moves the KV tensors, in the order kv_manager.py
gives). A block shared inside a group moves once and stays shared; a block whose device copy is
still prefix-cached comes back without a copy.
"""

from __future__ import annotations

from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.group_windows import GroupWindows
from octavo.paging.prefix_cache import PrefixCache
from octavo.paging.seq_blocks import SeqBlocks


class SwapSpace:
    def __init__(self, num_blocks: int, device_pool: BlockPool, prefix_cache: PrefixCache,
                 groups: GroupWindows) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.device_pool = device_pool
        self.prefix_cache = prefix_cache
        self.groups = groups

    def swap_out(self, states: list[SeqBlocks]) -> list[tuple[int, int]] | None:
        """Move the sequences to host blocks; the (device block, host block) copies, or None
        (nothing moves) when the host pool is too small."""
        host = self.pool
        distinct = {blk.block_id for s in states for t in s.blocks for blk in t if blk is not None}
        if len(distinct) > host.num_free_blocks:
            return None
        placed: dict[int, KVBlock] = {}
        copies: list[tuple[int, int]] = []
        for state in states:
            host_tables: list[list[KVBlock | None]] = []
            for table in state.blocks:
                host_blocks: list[KVBlock | None] = []
                for blk in table:
                    if blk is None:
                        host_blocks.append(None)
                        continue
                    dst = placed.get(blk.block_id)
                    if dst is None:
                        dst = placed[blk.block_id] = host.get_new_block()
                        host.set_filled(dst, blk.num_filled)
                        dst.token_ids = blk.token_ids
                        copies.append((blk.block_id, dst.block_id))
                    else:
                        host.touch(dst)
                    host_blocks.append(dst)
                self.device_pool.free(blk for blk in reversed(table) if blk is not None)
                host_tables.append(host_blocks)
            state.blocks, state.swapped = host_tables, True
        return copies

    def _swap_in_plan(self, states: list[SeqBlocks]) -> tuple[dict[int, KVBlock | None], int]:
        """For each distinct host block: the still-cached device block with the very same
        contents (reused without a copy), or None. Also the free device blocks it takes."""
        reuse: dict[int, KVBlock | None] = {}
        cache = self.prefix_cache
        for state in states:
            hashes = state.seq.block_hashes
            for g, (table, keys) in enumerate(zip(state.blocks, state.chain_keys, strict=True)):
                for i, host_blk in enumerate(table):
                    if host_blk is not None and host_blk.block_id not in reuse:
                        reuse[host_blk.block_id] = (
                            self.device_pool.get_block_by_key(cache.key(hashes[i], g), keys[i])
                            if i < len(keys)
                            else None
                        )
        copied = sum(target is None for target in reuse.values())
        revived = {t.block_id for t in reuse.values() if t is not None and t.ref_cnt == 0}
        return reuse, copied + len(revived)

    def swap_in(self, states: list[SeqBlocks]) -> list[tuple[int, int]] | None:
        """Bring the sequences back; the (host block, device block) copies, or None (nothing
        moves) when the free device blocks do not suffice."""
        pool, cache = self.device_pool, self.prefix_cache
        reuse, needed = self._swap_in_plan(states)
        if needed > pool.num_free_blocks:
            return None
        for target in reuse.values():  # one reference per host block, taken before any eviction
            if target is not None:
                pool.touch(target)
        placed: dict[int, tuple[KVBlock, int | None]] = {}
        copies: list[tuple[int, int]] = []
        for state in states:
            seq = state.seq
            device_tables: list[list[KVBlock | None]] = [[] for _ in self.groups.windows]
            for g in self.groups.order:
                table, keys = state.blocks[g], state.chain_keys[g]
                device_blocks: list[KVBlock | None] = []
                for i, host_blk in enumerate(table):
                    if host_blk is None:
                        device_blocks.append(None)
                        continue
                    full = i < len(keys)
                    if host_blk.block_id in placed:
                        blk, key = placed[host_blk.block_id]
                        pool.touch(blk)
                    elif (target := reuse[host_blk.block_id]) is not None:
                        blk, key = target, keys[i]
                    else:
                        blk, key = pool.get_new_block(), None
                        pool.set_filled(blk, host_blk.num_filled)
                        copies.append((host_blk.block_id, blk.block_id))
                        if full and host_blk.token_ids is not None:
                            key = cache.record_full_block(
                                blk, cache.key(seq.block_hashes[i], g), host_blk.token_ids,
                                cache.parent_key(state, g, i), seq)
                    placed[host_blk.block_id] = (blk, key)
                    if full:
                        keys[i] = key
                    device_blocks.append(blk)
                self.pool.free(blk for blk in reversed(table) if blk is not None)
                device_tables[g] = device_blocks
            state.blocks, state.swapped = device_tables, False
        return copies
