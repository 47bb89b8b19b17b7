"""The remote KV tier: records in Redis or Valkey, for replicas on several machines.

The same records as the disk tier (paging/tier/record.py: checksummed, naming their key and
tokens) under `octavo:kv:<fingerprint>:<block key>`, through redis-py (Valkey speaks the same
protocol). A SET is atomic, so a reader sees a whole record or none; SET NX keeps the first
writer's record when two replicas save the same block. The server bounds the tier: run it
with `maxmemory` and `maxmemory-policy allkeys-lru` and it evicts the least recently used
records itself (GET refreshes a record's LRU clock), which is why this store keeps no index.
Lookups and reads of a prefix take one pipelined round trip each.

A server that cannot be reached (down, restarting, a timeout) makes lookups miss and writes
fail, with a log line (rate-limited): the engine recomputes, as without a tier.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 5.0
INFO_EVERY_S = 5.0
LOG_EVERY_S = 30.0


class RedisStore:
    name = "redis"

    def __init__(self, url: str, namespace: str) -> None:
        try:
            import redis
        except ImportError as e:
            raise ValueError("kv_offload_url needs redis-py: pip install 'octavo[redis]'"
                             ) from e
        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S,
                                           socket_connect_timeout=SOCKET_TIMEOUT_S)
        self.url = url
        self.prefix = f"octavo:kv:{namespace}:".encode()
        self.write_errors = 0
        self.read_errors = 0
        self._last_log = -LOG_EVERY_S
        self._info: dict[str, int] = {}
        self._info_at = -INFO_EVERY_S
        try:
            self.client.ping()
        except self._errors as e:
            logger.warning("KV tier: Redis at %s does not answer (%s); the tier misses until "
                           "it does", url, e)

    def _name(self, key: bytes) -> bytes:
        return self.prefix + key

    def _log(self, what: str, e: Exception) -> None:
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            logger.warning("KV tier: Redis at %s: %s failed: %s", self.url, what, e)

    def contains(self, key: bytes) -> bool:
        return self.count_leading([key]) == 1

    def count_leading(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            present = pipe.execute()
        except self._errors as e:
            self.read_errors += 1
            self._log("a lookup", e)
            return 0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def get(self, key: bytes) -> bytearray | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        try:
            values = self.client.mget([self._name(k) for k in keys])
        except self._errors as e:
            self.read_errors += 1
            self._log("a read", e)
            return [None] * len(keys)
        return [None if v is None else bytearray(v) for v in values]

    def put(self, key: bytes, parts: Sequence[bytes | memoryview], size: int) -> bool:
        try:
            return bool(self.client.set(self._name(key), b"".join(parts), nx=True))
        except self._errors as e:
            self.write_errors += 1
            self._log("a write", e)
            return False

    def remove(self, key: bytes) -> None:
        try:
            self.client.delete(self._name(key))
        except self._errors as e:
            self._log("a delete", e)

    def _server_info(self) -> dict[str, int]:
        now = time.monotonic()
        if now - self._info_at >= INFO_EVERY_S:
            self._info_at = now
            try:
                info = {**self.client.info("memory"), **self.client.info("stats")}
                self._info = {"tier_bytes": int(info.get("used_memory", 0)),
                              "tier_bytes_limit": int(info.get("maxmemory", 0)),
                              "tier_evictions": int(info.get("evicted_keys", 0)),
                              "tier_blocks": int(self.client.dbsize())}
            except self._errors as e:
                self._log("INFO", e)
        return self._info

    def stats(self) -> dict[str, int]:
        """The server's occupancy (all of its database: it may hold more than this tier),
        limit and evictions, refreshed every few seconds."""
        return {"tier_bytes": 0, "tier_blocks": 0, "tier_bytes_limit": 0, "tier_evictions": 0,
                **self._server_info(), "tier_write_errors": self.write_errors}

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self.client.close()
