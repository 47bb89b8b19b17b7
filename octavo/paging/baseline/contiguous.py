"""The baseline octavo exists to beat: one contiguous KV buffer per sequence, reserved up front.

Same public interface as KVCacheManager, so the engine and benchmarks can swap one for the
other, but none of paging's benefits: no sharing, no prefix caching, no swapping, and every
reservation is sized before the sequence knows how long it will get. First-fit over a sorted
list of free extents; scanning extents is fine for a baseline, nothing here is per slot.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from octavo.paging.allocator import EMPTY_PREFIX, CachedPrefix, NewBlocks
from octavo.paging.kv_seq import KVSeq
from octavo.paging.waste import Reservation, check_slot_sum, contiguous_slot_stats

RESERVE_MODES = ("max_model_len", "request")


@dataclass(slots=True)
class _Run:
    seq: KVSeq
    start: int
    num_blocks: int
    final_tokens: int | None
    lookahead: int = 0  # draft-token slots of a speculative step, until accept_lookahead


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ContiguousAllocator:
    """Reserve-up-front KV allocation.

    reserve="max_model_len": every sequence reserves `max_model_len` tokens (the classic case).
    reserve="request": it reserves the sequence's `reserve_tokens` (prompt + max_tokens, set on
    the KVSeq by the scheduler; a call may pass it instead). External fragmentation counts free
    extents too small for one more reservation of the configured size; with reserve="request"
    that size is the smallest reservation seen so far (a free gap that cannot hold even that is
    useless to every request we have seen).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_model_len: int,
        reserve: str = "max_model_len",
    ) -> None:
        if num_blocks < 1 or block_size < 1 or max_model_len < 1:
            raise ValueError("num_blocks, block_size and max_model_len must all be >= 1")
        if reserve not in RESERVE_MODES:
            raise ValueError(f"reserve must be one of {RESERVE_MODES}, got {reserve!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reserve = reserve
        self._free: list[tuple[int, int]] = [(0, num_blocks)]  # (start, length), sorted, coalesced
        self._num_free = num_blocks
        self._runs: dict[int, _Run] = {}
        self._smallest_reservation: int | None = None
        self._peak_used = 0

    # -- allocation -----------------------------------------------------------------------------
    def reservation_blocks(self, num_new_tokens: int, reserve_tokens: int | None) -> int:
        """Blocks a new sequence reserves (ValueError: its tokens exceed the reservation)."""
        if self.reserve == "max_model_len":
            tokens = self.max_model_len
        elif reserve_tokens is None:
            raise ValueError('reserve="request" needs the sequence\'s reserve_tokens (or '
                             'allocate_slots(..., reserve_tokens=N))')
        else:
            tokens = reserve_tokens
        if num_new_tokens > tokens:
            raise ValueError(f"{num_new_tokens} new tokens exceed the {tokens}-token reservation")
        return max(_cdiv(tokens, self.block_size), 1)

    def _first_fit(self, num_blocks: int) -> int | None:
        for i, (_, length) in enumerate(self._free):
            if length >= num_blocks:
                return i
        return None

    def get_computed_blocks(self, seq: KVSeq) -> CachedPrefix:
        return EMPTY_PREFIX  # nothing is ever shared

    def allocate_slots(
        self,
        seq: KVSeq,
        num_new_tokens: int,
        cached: CachedPrefix | None = None,
        *,
        reserve_tokens: int | None = None,
        final_tokens: int | None = None,
        num_lookahead_tokens: int = 0,
    ) -> NewBlocks | None:
        """A new sequence reserves its whole buffer now (first fit), or gets None. Later calls
        never allocate: they succeed inside the reservation and return None past it, where no
        amount of freeing helps. `final_tokens`, when known (benchmarks know it), lets stats
        tell slots that will never be used (internal) from ones still to come (reserved).
        `num_lookahead_tokens`: draft-token slots after the new tokens (see KVCacheManager);
        here they only have to fit the reservation."""
        run = self._runs.get(seq.seq_id)
        end = seq.num_computed_tokens + num_new_tokens
        if num_new_tokens < 0 or end > len(seq.token_ids):
            raise ValueError(
                f"cannot compute {num_new_tokens} new tokens after {seq.num_computed_tokens} of "
                f"{len(seq.token_ids)} known tokens"
            )
        if run is not None:
            if run.seq is not seq:
                raise ValueError(f"sequence id {seq.seq_id} already has KV blocks")
            if cached is not None:
                raise ValueError(f"sequence {seq.seq_id} already has blocks: no cached prefix "
                                 "to add")
            if run.lookahead:
                raise ValueError(f"sequence {seq.seq_id} still holds lookahead slots")
            if end + num_lookahead_tokens > run.num_blocks * self.block_size:
                return None  # it outgrew its reservation
            seq.num_computed_tokens = end
            run.lookahead = num_lookahead_tokens
            return NewBlocks(run.num_blocks, [])
        if num_lookahead_tokens:
            raise ValueError(f"sequence {seq.seq_id}: lookahead slots need KV blocks already")
        if seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} counts computed tokens but has no blocks")
        n = self.reservation_blocks(num_new_tokens, reserve_tokens if reserve_tokens is not None
                                    else seq.reserve_tokens)
        i = self._first_fit(n)
        if i is None:
            return None
        start, length = self._free[i]
        if length == n:
            del self._free[i]
        else:
            self._free[i] = (start + n, length - n)
        self._num_free -= n
        self._peak_used = max(self._peak_used, self.num_blocks - self._num_free)
        if self._smallest_reservation is None or n < self._smallest_reservation:
            self._smallest_reservation = n
        self._runs[seq.seq_id] = _Run(seq, start, n, final_tokens)
        seq.num_computed_tokens = end
        return NewBlocks(0, list(range(start, start + n)))

    def accept_lookahead(self, seq_id: int, num_accepted: int) -> None:
        """The first `num_accepted` lookahead slots now hold known tokens (see KVCacheManager);
        the reservation keeps the rest."""
        run = self._runs.get(seq_id)
        if run is None:
            return
        if not 0 <= num_accepted <= run.lookahead:
            raise ValueError(f"sequence {seq_id}: {num_accepted} accepted of {run.lookahead} "
                             "lookahead slots")
        end = run.seq.num_computed_tokens + num_accepted
        if end > len(run.seq.token_ids):
            raise ValueError(f"sequence {seq_id}: {num_accepted} accepted tokens are not known")
        run.seq.num_computed_tokens = end
        run.lookahead = 0

    def fork(self, parent_id: int, child: KVSeq) -> None:
        raise NotImplementedError(
            "the contiguous baseline cannot share KV blocks between sequences, so it cannot fork "
            "(parallel sampling / beam search need the paged KVCacheManager)"
        )

    def free(self, seq_id: int) -> None:
        run = self._runs.pop(seq_id, None)
        if run is None:
            return
        run.seq.num_computed_tokens = 0
        start, n = run.start, run.num_blocks
        i = bisect.bisect_left(self._free, (start, 0))
        if i < len(self._free) and self._free[i][0] == start + n:  # merge with the next extent
            n += self._free[i][1]
            del self._free[i]
        prev_start, prev_len = self._free[i - 1] if i > 0 else (-1, 0)
        if i > 0 and prev_start + prev_len == start:  # merge with the previous extent
            start, n = self._free[i - 1][0], n + self._free[i - 1][1]
            i -= 1
            del self._free[i]
        self._free.insert(i, (start, n))
        self._num_free += run.num_blocks

    def uncache_from(self, seq_id: int, num_tokens: int) -> None:
        """Nothing is cached in the contiguous baseline."""

    def free_out_of_window(self, seq_id: int) -> int:
        """A contiguous reservation is kept whole, sliding window or not."""
        return 0

    def take_block_copies(self) -> list[tuple[int, int]]:
        return []

    # -- the KV tier: none (no prefix cache) ----------------------------------------------------
    def take_tier_io(self) -> tuple[list[int], list[tuple[int, memoryview]]]:
        return [], []

    def tier_io_done(self, saved: Sequence[bytes]) -> None:
        pass

    def tier_io_failed(self) -> None:
        pass

    def has_tier_saves(self) -> bool:
        return False

    # -- swap: not supported, a contiguous buffer is preempted by recomputation -----------------
    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        return None

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]] | None:
        raise ValueError("the contiguous baseline never swaps out, so nothing can swap in")

    # -- queries --------------------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]:
        run = self._get(seq_id)
        return list(range(run.start, run.start + run.num_blocks))

    def block_tables(self, seq_id: int) -> list[list[int]]:
        return [self.block_table(seq_id)]

    def num_free_blocks(self) -> int:
        return self._num_free

    def usage(self) -> float:
        return (self.num_blocks - self._num_free) / self.num_blocks

    def largest_free_extent(self) -> int:
        """Blocks in the longest free extent: no reservation longer than this fits."""
        return max((length for _, length in self._free), default=0)

    def layout(self) -> str:
        """One character per block (see kv_map.CONTIGUOUS_STATES): `u` reserved and holding
        tokens, `r` reserved for later tokens, `x` free in a gap too small for a reservation,
        `f` free."""
        bs = self.block_size
        threshold = self._external_threshold()
        segments: list[tuple[int, str]] = []
        for run in self._runs.values():
            used = min(_cdiv(run.seq.num_computed_tokens, bs), run.num_blocks)
            segments.append((run.start, "u" * used + "r" * (run.num_blocks - used)))
        for start, length in self._free:
            segments.append((start, ("x" if length < threshold else "f") * length))
        segments.sort()
        return "".join(cells for _, cells in segments)

    def _external_threshold(self) -> int:
        if self.reserve == "max_model_len":
            return _cdiv(self.max_model_len, self.block_size)
        return self._smallest_reservation or 1

    def stats(self) -> dict[str, int | float]:
        bs = self.block_size
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_blocks - self._num_free,
            "kv_blocks_cached_free": 0,
            **contiguous_slot_stats(
                block_size=bs,
                reservations=(
                    Reservation(r.seq.num_computed_tokens, r.num_blocks * bs, r.final_tokens)
                    for r in self._runs.values()
                ),
                free_extents=(length for _, length in self._free),
                min_reservation_blocks=self._external_threshold(),
            ),
            "kv_blocks_saved_by_sharing": 0,
            "prefix_cache_query_tokens": 0,
            "prefix_cache_hit_tokens": 0,
            "peak_kv_blocks_used": self._peak_used,
            "kv_cpu_blocks_total": 0,
            "kv_cpu_blocks_used": 0,
        }

    def check_invariants(self) -> None:
        owner: list[int | None] = [None] * self.num_blocks
        for seq_id, run in self._runs.items():
            assert run.seq.num_computed_tokens <= run.num_blocks * self.block_size, (
                f"seq {seq_id}: {run.seq.num_computed_tokens} tokens overflow its reservation"
            )
            for b in range(run.start, run.start + run.num_blocks):
                assert owner[b] is None, f"block {b} reserved by seq {seq_id} and {owner[b]}"
                owner[b] = seq_id
        prev_end = -1
        for start, length in self._free:
            assert length > 0, f"empty free extent at {start}"
            assert start > prev_end, f"free extents unsorted or not coalesced at block {start}"
            for b in range(start, start + length):
                assert owner[b] is None, f"free block {b} is reserved by seq {owner[b]}"
                owner[b] = -1
            prev_end = start + length
        assert None not in owner, f"block {owner.index(None)} is neither free nor reserved"
        assert self._num_free == sum(length for _, length in self._free), "free counter is stale"
        check_slot_sum(self.stats(), self.num_blocks * self.block_size)

    def _get(self, seq_id: int) -> _Run:
        try:
            return self._runs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} has no KV blocks") from None
