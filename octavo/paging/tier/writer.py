"""The tier's background writer: records are checksummed and stored on a thread of their own,
so a step never waits for the disk or the network.

The queue is bounded in bytes: when the store falls behind by more than `max_pending_bytes`, a
new block is dropped (counted) rather than held in memory; it is still in the pool and may be
offered again when it is freed again.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from octavo.paging.tier.record import encode, record_size
from octavo.paging.tier.store import TierStore

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 512 << 20
EXIT_FLUSH_S = 10.0  # at interpreter exit, queued records get this long to reach the store


class TierWriter:
    def __init__(self, store: TierStore, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 on_done: Callable[[bytes, bool], None] | None = None) -> None:
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self.on_done = on_done
        self._queue: queue.Queue[tuple[bytes, Sequence[int], bytes] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending_bytes = 0
        self._pending = 0
        self.blocks_written = 0
        self.bytes_written = 0
        self.blocks_dropped = 0
        self.write_seconds = 0.0
        self._thread: threading.Thread | None = None
        self._closed = False
        ref = weakref.ref(self)
        atexit.register(lambda: (w := ref()) is not None and w.close(EXIT_FLUSH_S))

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, key: bytes, token_ids: Sequence[int], payload: bytes) -> bool:
        """Queue one block's record; False when it is dropped (the writer is behind, or
        closed)."""
        with self._lock:
            if self._closed or self._pending_bytes + len(payload) > self.max_pending_bytes:
                self.blocks_dropped += 1
                return False
            self._pending_bytes += len(payload)
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="octavo-kv-tier-writer",
                                                daemon=True)
                self._thread.start()
        self._queue.put((key, token_ids, payload))
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, token_ids, payload = item
            started = time.perf_counter()
            try:
                parts = encode(key, token_ids, payload)
                size = record_size(key, len(token_ids), len(payload))
                written = self.store.put(key, parts, size)
            except Exception:  # a store bug must not kill the thread that drains the queue
                logger.exception("KV tier: writing a block failed")
                written = False
            elapsed = time.perf_counter() - started
            with self._lock:
                self._pending_bytes -= len(payload)
                self._pending -= 1
                self.write_seconds += elapsed
                if written:
                    self.blocks_written += 1
                    self.bytes_written += size
                if not self._pending:
                    self._idle.notify_all()
            if self.on_done is not None:
                self.on_done(key, written)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued record was stored (or failed); False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Store what is queued (up to `timeout` seconds), then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return {"tier_blocks_written": self.blocks_written,
                    "tier_bytes_written": self.bytes_written,
                    "tier_blocks_write_dropped": self.blocks_dropped,
                    "tier_writes_pending": self._pending,
                    "tier_write_seconds": self.write_seconds}
