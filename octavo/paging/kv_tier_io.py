"""The KV cache manager's side of the KV tier (tier/kv_tier.py): a prefix's tier hits read and
given fresh blocks, their loads queued (and cancelled when their sequence goes first), and each
step's tier traffic handed to the runner and settled after the step.

KVTierIO is a part of KVCacheManager (kv_manager.py), which inherits it: it works on the
manager's block pool, prefix cache and block tables, and does nothing where the manager has no
tier.
"""

from __future__ import annotations

from collections.abc import Sequence

from octavo.paging.block_pool import BlockPool
from octavo.paging.group_windows import GroupWindows
from octavo.paging.kv_seq import KVSeq
from octavo.paging.prefix_cache import PrefixCache
from octavo.paging.seq_blocks import SeqBlocks
from octavo.paging.tier.kv_tier import KVTier


class KVTierIO:
    """Blocks to and from the KV tier, through the manager's pool and prefix cache."""

    # the manager's parts (KVCacheManager.__init__)
    block_size: int
    block_pool: BlockPool
    prefix_cache: PrefixCache
    groups: GroupWindows
    tier: KVTier | None

    # -- a prefix's tier hits -------------------------------------------------------------------
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

    # -- the step's tier traffic ----------------------------------------------------------------
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
