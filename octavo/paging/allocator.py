"""The interface the engine programs against; KVCacheManager and ContiguousAllocator both fit."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class KVAllocator(Protocol):
    block_size: int
    num_blocks: int

    def find_cached_prefix(
        self, token_ids: Sequence[int], extra_key: Hashable | None = None
    ) -> int: ...

    def can_allocate(
        self,
        token_ids: Sequence[int],
        num_new_tokens: int,
        extra_key: Hashable | None = None,
        *,
        reserve_tokens: int | None = None,
        use_prefix_cache: bool = True,
    ) -> bool: ...

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_new_tokens: int,
        extra_key: Hashable | None = None,
        *,
        reserve_tokens: int | None = None,
        final_tokens: int | None = None,
        use_prefix_cache: bool = True,
    ) -> int: ...

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> int: ...

    def can_append_slots(self, seq_id: int, num_new_tokens: int) -> bool: ...

    def append_slots(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int) -> None: ...

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def free(self, seq_id: int) -> None: ...

    def uncache_from(self, seq_id: int, num_tokens: int) -> None: ...

    def take_block_copies(self) -> list[tuple[int, int]]: ...

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool: ...

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]: ...

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool: ...

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]: ...

    def block_table(self, seq_id: int) -> list[int]: ...

    def num_computed_tokens(self, seq_id: int) -> int: ...

    def num_free_blocks(self) -> int: ...

    def usage(self) -> float: ...

    def stats(self) -> dict[str, int | float]: ...

    def check_invariants(self) -> None: ...
