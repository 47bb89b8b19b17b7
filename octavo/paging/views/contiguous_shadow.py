"""The same traffic as a contiguous allocator would have laid it out: the seed's comparison, live.

A ContiguousShadow follows the sequences the paged cache really holds and replays them into a
ContiguousAllocator of the same size: a sequence that appears reserves its whole buffer first
fit (prompt + max_tokens, or max_model_len), one that is gone frees it, and the tokens each
holds are the real sequence's. What the shadow cannot fit is counted, not placed: in a
contiguous engine those sequences would wait. It sees the traffic only when `sync` runs (each
snapshot of the page map), so a sequence that came and went between two syncs is missed.
Nothing here touches the real cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from octavo.paging.baseline.contiguous import ContiguousAllocator
from octavo.paging.kv_seq import KVSeq


class ContiguousShadow:
    def __init__(self, num_blocks: int, block_size: int, *, max_model_len: int,
                 reserve: str) -> None:
        self.reserve = reserve
        self.alloc = ContiguousAllocator(num_blocks, block_size, max_model_len=max_model_len,
                                         reserve=reserve)
        self._seqs: dict[int, KVSeq] = {}
        self.num_not_placed = 0
        self._room = num_blocks  # the longest free extent, kept during a sync

    def sync(self, live: Iterable[tuple[KVSeq, int]]) -> None:
        """`live`: each sequence holding KV now, with the tokens a contiguous engine would have
        reserved for it (prompt + max_tokens); placed in sequence-id (arrival) order."""
        now = {seq.seq_id: (seq, reserve) for seq, reserve in live}
        for seq_id in [s for s in self._seqs if s not in now]:
            self.alloc.free(seq_id)
            del self._seqs[seq_id]
        not_placed = 0
        self._room = self.alloc.largest_free_extent()
        for seq_id in sorted(now):
            real, reserve = now[seq_id]
            filled = real.num_computed_tokens
            shadow = self._seqs.get(seq_id)
            if shadow is not None and shadow.num_computed_tokens > filled:
                self.alloc.free(seq_id)  # it restarted (recomputed after a preemption)
                del self._seqs[seq_id]
                self._room = self.alloc.largest_free_extent()
                shadow = None
            if shadow is None:
                if not self._place(seq_id, real, filled, reserve):
                    not_placed += 1
            elif filled > shadow.num_computed_tokens:
                self.alloc.allocate_slots(shadow, filled - shadow.num_computed_tokens)
        self.num_not_placed = not_placed

    def _place(self, seq_id: int, real: KVSeq, filled: int, reserve: int) -> bool:
        shadow = KVSeq(seq_id, ())
        shadow.token_ids = real.token_ids  # only its length is read
        try:
            blocks = self.alloc.reservation_blocks(filled, max(reserve, 1))
        except ValueError:
            return False  # it outgrew what a contiguous engine reserves: that one would fail
        if blocks > self._room:
            return False  # no free extent is long enough (skips the first-fit scan)
        if self.alloc.allocate_slots(shadow, filled, reserve_tokens=max(reserve, 1)) is None:
            return False
        self._seqs[seq_id] = shadow
        self._room = self.alloc.largest_free_extent()
        return True

    def snapshot(self) -> dict[str, Any]:
        stats = self.alloc.stats()
        return {
            "reserve": self.reserve,
            "states": self.alloc.layout(),
            "num_seqs_placed": len(self._seqs),
            "num_seqs_not_placed": self.num_not_placed,
            "slots": {k: v for k, v in stats.items() if k.startswith("kv_slots_")},
        }
