"""Swap: move groups of sequences' blocks to the CPU pool and back.

KVCacheManager records the copies and the runner moves the KV tensors (kv_manager.py says in
which order within a step). A block shared inside a group moves once and stays shared; a
block whose GPU copy is still prefix-cached comes back without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

from octavo.paging.block_pool import BlockPool, KVBlock
from octavo.paging.seq_blocks import SeqBlocks


class KVSwap:
    """KVCacheManager's swap (a mixin: the manager owns the state)."""

    block_size: int
    windows: tuple[int | None, ...]
    block_pool: BlockPool
    cpu_pool: BlockPool
    _group_order: list[int]

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Move a group of sequences to CPU blocks and return the (gpu_block, cpu_block)
        copies, or None (nothing moves) when the CPU pool is too small. A block shared inside
        the group is copied once and stays shared; its GPU copy stays prefix-cached."""
        states = self._group(seq_ids, swapped=False)
        for state in states:
            if state.lookahead:
                raise ValueError(f"sequence {state.seq.seq_id} holds lookahead slots: accept "
                                 "them first")
        for state in states:
            self.free_out_of_window(state.seq.seq_id)  # nothing to carry that nobody reads
        cpu = self.cpu_pool
        distinct = {blk.block_id for s in states for t in s.blocks for blk in t if blk is not None}
        if len(distinct) > cpu.num_free_blocks:
            return None
        placed: dict[int, KVBlock] = {}
        copies: list[tuple[int, int]] = []
        for state in states:
            cpu_tables: list[list[KVBlock | None]] = []
            for table in state.blocks:
                cpu_blocks: list[KVBlock | None] = []
                for blk in table:
                    if blk is None:
                        cpu_blocks.append(None)
                        continue
                    dst = placed.get(blk.block_id)
                    if dst is None:
                        dst = placed[blk.block_id] = cpu.get_new_block()
                        cpu.set_filled(dst, blk.num_filled)
                        dst.token_ids = blk.token_ids
                        copies.append((blk.block_id, dst.block_id))
                    else:
                        cpu.touch(dst)
                    cpu_blocks.append(dst)
                self.block_pool.free(blk for blk in reversed(table) if blk is not None)
                cpu_tables.append(cpu_blocks)
            state.blocks, state.swapped = cpu_tables, True
        return copies

    def _swap_in_plan(self, states: list[SeqBlocks]) -> tuple[dict[int, KVBlock | None], int]:
        """For each distinct CPU block: the still-cached GPU block with the very same contents
        (reused without a copy), or None. Also the number of free GPU blocks it takes."""
        reuse: dict[int, KVBlock | None] = {}
        for state in states:
            hashes = state.seq.block_hashes
            for g, (table, keys) in enumerate(zip(state.blocks, state.chain_keys, strict=True)):
                for i, cpu_blk in enumerate(table):
                    if cpu_blk is not None and cpu_blk.block_id not in reuse:
                        reuse[cpu_blk.block_id] = (
                            self.block_pool.get_block_by_key(self._key(hashes[i], g), keys[i])
                            if i < len(keys)
                            else None
                        )
        copied = sum(target is None for target in reuse.values())
        revived = {t.block_id for t in reuse.values() if t is not None and t.ref_cnt == 0}
        return reuse, copied + len(revived)

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        """Bring a swapped group back and return the (cpu_block, gpu_block) copies, or None
        (nothing moves) when the free GPU blocks do not suffice."""
        states = self._group(seq_ids, swapped=True)
        pool = self.block_pool
        reuse, needed = self._swap_in_plan(states)
        if needed > pool.num_free_blocks:
            return None
        for target in reuse.values():  # one reference per CPU block, taken before any eviction
            if target is not None:
                pool.touch(target)
        placed: dict[int, tuple[KVBlock, int | None]] = {}
        copies: list[tuple[int, int]] = []
        for state in states:
            seq = state.seq
            gpu_tables: list[list[KVBlock | None]] = [[] for _ in self.windows]
            for g in self._group_order:
                table, keys = state.blocks[g], state.chain_keys[g]
                gpu_blocks: list[KVBlock | None] = []
                for i, cpu_blk in enumerate(table):
                    if cpu_blk is None:
                        gpu_blocks.append(None)
                        continue
                    full = i < len(keys)
                    if cpu_blk.block_id in placed:
                        gpu, key = placed[cpu_blk.block_id]
                        pool.touch(gpu)
                    elif (target := reuse[cpu_blk.block_id]) is not None:
                        gpu, key = target, keys[i]
                    else:
                        gpu, key = pool.get_new_block(), None
                        pool.set_filled(gpu, cpu_blk.num_filled)
                        copies.append((cpu_blk.block_id, gpu.block_id))
                        if full and cpu_blk.token_ids is not None:
                            key = self._record_full_block(
                                gpu, self._key(seq.block_hashes[i], g), cpu_blk.token_ids,
                                self._parent_key(state, g, i), seq)
                    placed[cpu_blk.block_id] = (gpu, key)
                    if full:
                        keys[i] = key
                    gpu_blocks.append(gpu)
                self.cpu_pool.free(blk for blk in reversed(table) if blk is not None)
                gpu_tables[g] = gpu_blocks
            state.blocks, state.swapped = gpu_tables, False
        return copies
