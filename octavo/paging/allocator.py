"""The interface the scheduler programs against; KVCacheManager and ContiguousAllocator both fit.

Every call that takes blocks either does all of it or returns None and does nothing: the
scheduler never asks "would it fit?" before acting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from octavo.paging.kv_seq import KVSeq


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A new sequence's leading full blocks found in the prefix cache (no references taken)."""

    # per KV cache group, one entry per leading block: a KVBlock, or None for a block a
    # sliding-window group no longer needs (it lies wholly before the window)
    blocks: tuple[tuple[Any, ...], ...]
    num_tokens: int


EMPTY_PREFIX = CachedPrefix(((),), 0)  # no hit, in a KV cache of one group


@dataclass(frozen=True, slots=True)
class NewBlocks:
    """What allocate_slots changed: the block table reads `block_ids` from entry `start` on
    (usually the blocks appended; from a copy-on-write copy's place; everything on a start)."""

    start: int
    block_ids: list[int]
    # groups 1, 2, ... of a hybrid KV cache (local and global layers), each (start, block ids)
    # like group 0's above; empty for a model with one kind of attention
    other_groups: tuple[tuple[int, list[int]], ...] = ()


@runtime_checkable
class KVAllocator(Protocol):
    block_size: int
    num_blocks: int

    def get_computed_blocks(self, seq: KVSeq) -> CachedPrefix: ...

    def allocate_slots(
        self,
        seq: KVSeq,
        num_new_tokens: int,
        cached: CachedPrefix | None = None,
        *,
        num_lookahead_tokens: int = 0,
    ) -> NewBlocks | None: ...

    def accept_lookahead(self, seq_id: int, num_accepted: int) -> None: ...

    def fork(self, parent_id: int, child: KVSeq) -> None: ...

    def free(self, seq_id: int) -> None: ...

    def uncache_from(self, seq_id: int, num_tokens: int) -> None: ...

    def free_out_of_window(self, seq_id: int) -> int: ...

    def take_block_copies(self) -> list[tuple[int, int]]: ...

    def take_tier_io(self) -> tuple[list[int], list[tuple[int, memoryview]]]: ...

    def tier_io_done(self, saved: Sequence[bytes]) -> None: ...

    def tier_io_failed(self) -> None: ...

    def has_tier_saves(self) -> bool: ...

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None: ...

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None: ...

    def block_table(self, seq_id: int) -> list[int]: ...

    def block_tables(self, seq_id: int) -> list[list[int]]: ...

    def num_free_blocks(self) -> int: ...

    def usage(self) -> float: ...

    def stats(self) -> dict[str, int | float]: ...

    def check_invariants(self) -> None: ...
