"""A KV tier record under tensor parallelism: one record per block, holding every rank's shard.

Each rank's KV cache holds only its own KV heads (model/parallel/tensor_parallel.py), so one
rank's copy of a block is a shard of it. The record of a block is the ranks' shards, each as
that rank's `KVCache.read_block` gave it, concatenated in rank order:

    rank 0's bytes | rank 1's bytes | ... | rank size-1's bytes

The shards may differ in size (3 KV heads over 2 ranks go 2 + 1); their sizes are known at
start-up (`TierShards`, from each rank's `block_nbytes`). Why this layout:

- one record per block, as with one rank: the KV manager, the stores, the checksums, the
  counters and the page map do not know about ranks, and a block is loaded whole or not at all
  (records per rank would need every rank's load of a block to succeed, or all to fail, before
  the step);
- each rank's slice is one contiguous range of the payload, so a save is a concatenation and a
  load a slice, with no reordering of heads on the way;
- re-interleaving the heads into one rank's layout would buy nothing: K and V computed by
  another number of ranks are other numbers (the all-reduces sum the partial results in
  another order), so a record is only ever read at the tensor-parallel size that wrote it (the
  fingerprint says which: engine/kv_tier_setup.py).

The executor owns the layout: it joins the ranks' saved bytes after a step (`join`) and sends
each rank only its own slice of a step's loads (`split`); the runner of every rank reads and
writes its blocks exactly as it does alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierShards:
    sizes: tuple[int, ...]  # the bytes of one block in each rank's KV cache, rank order

    @property
    def record_bytes(self) -> int:
        return sum(self.sizes)

    def split(self, loads: Sequence[tuple[int, bytes | bytearray | memoryview]]
              ) -> list[list[tuple[int, bytes]]]:
        """A plan's tier_loads (block id, whole record payload) as each rank's: (block id, its
        slice), copied into bytes (a memoryview does not travel to a worker)."""
        per_rank: list[list[tuple[int, bytes]]] = [[] for _ in self.sizes]
        for block_id, payload in loads:
            view = memoryview(payload).cast("B")
            if view.nbytes != self.record_bytes:
                raise ValueError(f"a KV tier record of this tensor-parallel group holds "
                                 f"{self.record_bytes} bytes (ranks' shards {list(self.sizes)}), "
                                 f"block {block_id} got {view.nbytes}")
            start = 0
            for rank, size in enumerate(self.sizes):
                per_rank[rank].append((block_id, bytes(view[start:start + size])))
                start += size
        return per_rank

    def join(self, saved: Sequence[Sequence[bytes]], num_blocks: int) -> list[bytes]:
        """The ranks' copies of a plan's `num_blocks` tier_saves (saved[rank][i]: block i's
        shard) as one payload per block."""
        if len(saved) != len(self.sizes):
            raise ValueError(f"{len(saved)} ranks' saved blocks for {len(self.sizes)} ranks")
        for rank, (blocks, size) in enumerate(zip(saved, self.sizes, strict=True)):
            if len(blocks) != num_blocks or any(len(b) != size for b in blocks):
                raise ValueError(f"rank {rank} copied out {[len(b) for b in blocks]} bytes for "
                                 f"{num_blocks} blocks of {size} bytes each")
        return [b"".join(shards) for shards in zip(*saved, strict=True)]
