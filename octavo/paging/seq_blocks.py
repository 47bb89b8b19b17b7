"""What the KV cache manager keeps of one sequence: its block tables and cache chain keys, and
for a model with recurrent layers its state slot (state_slots.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.paging.block_pool import KVBlock
from octavo.paging.kv_seq import KVSeq


@dataclass(slots=True)
class SeqBlocks:
    seq: KVSeq  # the caller's sequence: its tokens, block hashes and computed-token counter
    # Per KV cache group: the block table, GPU blocks or CPU blocks while swapped out. A
    # sliding-window group holds None where a block lay wholly before the window and went
    # back to the pool.
    blocks: list[list[KVBlock | None]]
    # Per group, per registered full block: the cache key of an indexed block with the same
    # whole prefix (None when none could be indexed). Its length is the number of blocks
    # registered so far.
    chain_keys: list[list[int | None]]
    swapped: bool = False
    # per group: entries below this are None (freed out of the window), so trimming is O(1)
    trimmed: list[int] = field(default_factory=list)
    # slots handed out past the known tokens for draft tokens (speculative decoding), until
    # accept_lookahead says how many of them the step's verification kept
    lookahead: int = 0
    # recurrent layers: the slot holding the state after the computed tokens (a host slot
    # while swapped out), and the snapshots this step takes, (block boundary, slot), until
    # the step ran
    state: KVBlock | None = None
    state_pending: list[tuple[int, KVBlock]] = field(default_factory=list)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
