"""Where the KV slots go: live tokens versus the three kinds of waste paging exists to remove.

Every slot of the cache is in exactly one share, so the shares always sum to the total:
- live: holds a token of a live sequence (a slot shared by several sequences counts once);
- internal: allocated to a sequence but never going to hold one of its tokens (or holding one
  that left a sliding window: no query will read it again);
- reserved: held now for tokens the sequence will only produce later;
- external: free, but in a gap too small for another reservation (contiguous allocation only);
- free: free and usable.
Both allocators build their stats with these helpers, so the arithmetic is written once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SLOT_KEYS = {
    "live": "kv_slots_live",
    "internal": "kv_slots_internal_waste",
    "reserved": "kv_slots_reserved_waste",
    "external": "kv_slots_external_waste",
    "free": "kv_slots_free",
}


@dataclass(slots=True, frozen=True)
class Reservation:
    """One contiguous reservation: tokens written so far, slots reserved, final length if known."""

    filled: int
    reserved_slots: int
    final_tokens: int | None = None


def slot_stats(
    *, live: int, internal: int, reserved: int, external: int, free: int
) -> dict[str, int]:
    shares = {
        "live": live,
        "internal": internal,
        "reserved": reserved,
        "external": external,
        "free": free,
    }
    for share, n in shares.items():
        assert n >= 0, f"negative {share} slot count {n}"
    return {SLOT_KEYS[share]: n for share, n in shares.items()}


def paged_slot_stats(
    *, block_size: int, num_used_blocks: int, num_free_blocks: int, live_slots: int
) -> dict[str, int]:
    """Paging only wastes the unfilled tail of each sequence's last block (internal)."""
    return slot_stats(
        live=live_slots,
        internal=num_used_blocks * block_size - live_slots,
        reserved=0,
        external=0,
        free=num_free_blocks * block_size,
    )


def contiguous_slot_stats(
    *,
    block_size: int,
    reservations: Iterable[Reservation],
    free_extents: Iterable[int],
    min_reservation_blocks: int,
) -> dict[str, int]:
    """Slots past a known final length are internal waste; the rest of the unfilled reservation
    is reservation waste; free extents shorter than `min_reservation_blocks` are external."""
    live = internal = reserved = 0
    for r in reservations:
        live += r.filled
        tail = 0 if r.final_tokens is None else r.reserved_slots - max(r.filled, r.final_tokens)
        tail = max(tail, 0)
        internal += tail
        reserved += r.reserved_slots - r.filled - tail
    external = free = 0
    for n in free_extents:
        if n < min_reservation_blocks:
            external += n * block_size
        else:
            free += n * block_size
    return slot_stats(live=live, internal=internal, reserved=reserved, external=external, free=free)


def check_slot_sum(stats: Mapping[str, int | float], total_slots: int) -> None:
    parts = {key: stats[key] for key in SLOT_KEYS.values()}
    assert sum(parts.values()) == total_slots, (
        f"slot shares {parts} sum to {sum(parts.values())}, not the {total_slots} total slots"
    )


class WasteTracker:
    """Accumulates each share as a fraction of total slots over steps: peak and (weighted) mean."""

    def __init__(self) -> None:
        self._weight = 0.0
        self._sums = dict.fromkeys(SLOT_KEYS, 0.0)
        self._peaks = dict.fromkeys(SLOT_KEYS, 0.0)

    def sample(self, stats: Mapping[str, int | float], weight: float = 1.0) -> None:
        """Call once per step; `weight` (e.g. the step's duration) makes the mean time-averaged."""
        total = sum(stats[key] for key in SLOT_KEYS.values())
        if total <= 0:
            return
        self._weight += weight
        for share, key in SLOT_KEYS.items():
            frac = stats[key] / total
            self._sums[share] += frac * weight
            self._peaks[share] = max(self._peaks[share], frac)

    def summary(self) -> dict[str, dict[str, float]]:
        w = self._weight
        return {
            share: {"mean": self._sums[share] / w if w else 0.0, "peak": self._peaks[share]}
            for share in SLOT_KEYS
        }
