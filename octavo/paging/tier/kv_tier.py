"""The KV manager's side of the tier: which blocks go down, which come back, and the counters.

The KV manager owns one KVTier (like its SwapSpace) and the runner moves the bytes:

- down (a save): a full block the prefix cache indexes is offered when the pool lets go of it,
  when its last holder frees it (`write="free"`: a restart or another server finds it at once)
  or only when the pool evicts it (`write="evict"`). Its key and token ids are noted then; the
  next plan lists its block id in `tier_saves`, the runner copies the bytes out first thing in
  that step (before anything can write over the block), and `io_done` hands them to the
  background writer (writer.py).
- up (a load): `PrefixCache.lookup` names blocks the pool misses but the tier holds
  (`TierBlock`); when the sequence starts, the KV manager reads and checks each record here
  (`read`: a missing, corrupt or racing one answers None, and the lookup is redone without it,
  so the sequence recomputes from there) and gives the payload a fresh block; the plan carries
  (block id, payload) in `tier_loads`, written into the pool before the forward pass reads it.

Reads are synchronous, on the engine thread, when a sequence starts: the alternative to them
is recomputing the same blocks in the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from octavo.paging.block_pool import KVBlock
from octavo.paging.tier.record import TierRecordError, decode
from octavo.paging.tier.store import TierStore
from octavo.paging.tier.writer import DEFAULT_MAX_PENDING_BYTES, TierWriter

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("free", "evict")


@dataclass(frozen=True, slots=True)
class TierBlock:
    """A block of a cached prefix that the tier holds and the pool does not (see lookup)."""

    key: bytes


@dataclass(slots=True)
class _Save:
    block_id: int
    key: bytes
    token_ids: tuple[int, ...]


class KVTier:
    def __init__(self, store: TierStore, *, write: str = "free",
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        if write not in WRITE_POLICIES:
            raise ValueError(f"tier write policy must be one of {WRITE_POLICIES}, got {write!r}")
        self.store = store
        self.write = write
        self.writer = TierWriter(store, max_pending_bytes, on_done=self._done)
        self._saves: list[_Save] = []  # noted, not yet in a plan
        self._inflight_saves: list[_Save] = []  # in the plan being executed
        self._queued: set[bytes] = set()  # noted or being written: not offered twice
        self._loads: dict[int, memoryview] = {}  # block id -> payload, not yet in a plan
        self._inflight_loads: list[int] = []
        self.last_loaded: list[int] = []  # the block ids the last plan loaded (the page map)
        self._bad: set[bytes] = set()  # records that failed to load, until written again
        self.hit_tokens = 0
        self.blocks_loaded = 0
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.reads = 0  # sequences' reads (each of all the tier blocks its prefix needs)
        self.read_failures = 0

    # -- lookups and loads (engine thread) ------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key not in self._bad and self.store.contains(key)

    def count_leading(self, keys: Sequence[bytes]) -> int:
        """How many of the leading `keys` the tier holds (as far as `contains` knows)."""
        for n, key in enumerate(keys):
            if key in self._bad:
                keys = keys[:n]
                break
        return self.store.count_leading(keys) if keys else 0

    def read(self, keys: Sequence[bytes], token_ids: Sequence[Sequence[int]]
             ) -> list[memoryview] | None:
        """The checked payloads of blocks `keys` over `token_ids`, or None (logged) when one
        fails: a missing, truncated, corrupt or foreign record is never loaded, and the tier
        forgets it (so a lookup stops before it)."""
        started = time.perf_counter()
        records = self.store.get_many(keys)
        payloads: list[memoryview] = []
        failed = None
        for key, toks, data in zip(keys, token_ids, records, strict=True):
            if data is None:
                failed = key, "missing (removed by another server, or the directory vanished)"
                break
            try:
                payloads.append(decode(data, key, toks))
            except TierRecordError as e:
                self.store.remove(key)  # nobody can use it
                failed = key, str(e)
                break
            self.bytes_read += len(data)
        self.read_seconds += time.perf_counter() - started
        self.reads += 1
        if failed is None:
            return payloads
        self.read_failures += 1
        self._bad.add(failed[0])
        logger.warning("KV tier: block %s not loaded (%s); recomputing from there",
                       failed[0].hex()[:16], failed[1])
        return None

    def add_load(self, block_id: int, payload: memoryview) -> None:
        self._loads[block_id] = payload
        self.blocks_loaded += 1

    def has_pending_load(self, block_id: int) -> bool:
        return block_id in self._loads

    def cancel_load(self, block_id: int) -> None:
        """The block was let go before any step loaded it (its sequence did not start after
        all): nothing is written into it."""
        del self._loads[block_id]
        self.blocks_loaded -= 1

    # -- saves (engine thread) ------------------------------------------------------------------
    def offer(self, blk: KVBlock) -> None:
        """The pool lets go of a full, indexed block (freed or evicted, per the write policy):
        note it for the next plan unless the tier has it or it is on its way."""
        key = blk.block_hash
        if (key is None or blk.token_ids is None or key in self._queued
                or blk.block_id in self._loads or self.contains(key)):
            return
        self._queued.add(key)
        self._saves.append(_Save(blk.block_id, key, blk.token_ids))

    @property
    def has_pending_saves(self) -> bool:
        return bool(self._saves)

    def saving_block_ids(self) -> list[int]:
        """Blocks on their way down: noted, waiting for the next step to copy them out (the
        page map)."""
        return [s.block_id for s in self._saves]

    # -- a step's I/O ---------------------------------------------------------------------------
    def take_io(self) -> tuple[list[int], list[tuple[int, memoryview]]]:
        """This plan's saves (block ids whose bytes the runner copies out before anything else)
        and loads ((block id, payload), written before the forward pass)."""
        self._inflight_saves, self._saves = self._saves, []
        loads = list(self._loads.items())
        self._inflight_loads = self.last_loaded = [b for b, _ in loads]
        self._loads = {}
        return [s.block_id for s in self._inflight_saves], loads

    def io_done(self, saved: Sequence[bytes]) -> None:
        """The step ran: queue the saved blocks' bytes (in the plan's order) for writing."""
        saves, self._inflight_saves = self._inflight_saves, []
        self._inflight_loads = []
        if len(saved) != len(saves):
            raise ValueError(f"the runner copied out {len(saved)} blocks for {len(saves)} saves")
        for save, data in zip(saves, saved, strict=True):
            if not self.writer.submit(save.key, save.token_ids, data):
                self._queued.discard(save.key)

    def io_failed(self) -> list[int]:
        """The step raised: its saves are forgotten (the blocks may be offered again) and the
        blocks it was to load are returned: their contents are unknown, so the caller takes
        them out of the prefix cache."""
        for save in self._inflight_saves:
            self._queued.discard(save.key)
        self._inflight_saves = []
        failed, self._inflight_loads = self._inflight_loads, []
        return failed

    def _done(self, key: bytes, written: bool) -> None:  # the writer's thread
        self._queued.discard(key)
        if written:
            self._bad.discard(key)

    # -- the rest -------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the writer (tests, shutdown)."""
        if self._saves:
            logger.debug("KV tier: %d saves still wait for a step", len(self._saves))
        return self.writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.writer.close(timeout)
        self.store.close()

    def stats(self) -> dict[str, int | float]:
        return {
            "tier_hit_tokens": self.hit_tokens,
            "tier_blocks_loaded": self.blocks_loaded,
            "tier_bytes_read": self.bytes_read,
            "tier_read_seconds": self.read_seconds,
            "tier_reads": self.reads,
            "tier_read_failures": self.read_failures,
            "tier_saves_waiting": len(self._saves),
            **self.writer.stats(),
            **self.store.stats(),
        }
