"""The disk tier: one file per KV block under a directory that several servers may share.

Layout: `<dir>/<first two hex digits of the key>/<key hex>.kvb`. A record is written to a
temporary file in the same sub-directory and renamed over its name, so a reader (this process
or another) opens either a whole record or nothing; the record's own checksum catches what the
file system does not (a torn page after a crash, a flipped bit).

Bounded size, least recently used first out: every process keeps an index of the records it
knows (from a scan at start, its own writes and its hits) with their sizes and last use; a hit
touches the file's mtime so other processes see the use. When the bytes this process counts
pass the bound, it scans the directory again (the other writers' records included), and unlinks
the oldest by mtime until it is under the bound less a margin. The bound is therefore soft with
several writers: each can overshoot it by what the others wrote since its last scan. Unlinking
a file another process is reading is safe on POSIX (the reader keeps its open file); a reader
that comes after finds nothing and recomputes.

Nothing here raises on a file system error: a full disk, a vanished directory or an unreadable
file makes a write fail or a read miss, with a log line (rate-limited) and a counter.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600.0  # a temporary file older than this was left by a process that died
EVICT_MARGIN = 0.9  # evicting brings the bytes down to this share of the bound
LOG_EVERY_S = 30.0


class DiskStore:
    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"a disk tier needs a positive size bound, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> size, least recent first
        self._bytes = 0
        self.evictions = 0
        self.write_errors = 0
        self.read_errors = 0
        self._last_log: dict[str, float] = {}
        self._make_dirs()
        self.scan()

    # -- paths ----------------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

    def _make_dirs(self) -> bool:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return True
        except OSError as e:
            self._log("mkdir", "KV tier directory %s cannot be created: %s", self.root, e)
            return False

    def _log(self, what: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log.get(what, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[what] = now
            logger.warning(msg, *args)

    # -- the index ------------------------------------------------------------------------------
    def scan(self) -> None:
        """Rebuild the index from the directory (every process's records), oldest first, and
        remove temporary files a dead writer left behind."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        try:
            subdirs = list(os.scandir(self.root))
        except OSError as e:
            self._log("scan", "KV tier directory %s cannot be read: %s", self.root, e)
            subdirs = []
        for sub in subdirs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if entry.name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        _unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                except ValueError:
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._bytes = sum(size for _, _, size in found)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def _note(self, key: bytes, size: int) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            self._index[key] = size
            self._bytes += size - (old or 0)

    # -- TierStore ------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._index:
                return True
        try:  # another process may have written it since the last scan
            size = os.stat(self.path(key)).st_size
        except OSError:
            return False
        self._note(key, size)
        return True

    def count_leading(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        return [self.get(key) for key in keys]

    def get(self, key: bytes) -> bytearray | None:
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                view = memoryview(buf)
                got = 0
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        break  # shrank under us: the record check refuses what is left
                    got += n
                view.release()
        except FileNotFoundError:
            if self.root.is_dir():
                self._forget(key)
            else:  # the whole tier is gone: so is everything the index knew
                self.scan()
            return None
        except OSError as e:
            self.read_errors += 1
            self._log("read", "KV tier record %s cannot be read: %s", path, e)
            return None
        if got < size:
            del buf[got:]
        with contextlib.suppress(OSError):  # the last use, for every process's LRU order
            os.utime(path)
        self._note(key, size)
        return buf

    def put(self, key: bytes, parts: Sequence[bytes | memoryview], size: int) -> bool:
        path = self.path(key)
        if path.exists():
            self._note(key, size)
            return False
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        for attempt in (0, 1):
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                break
            except FileNotFoundError:
                # the sub-directory (or the whole tier) is not there (yet, or any more)
                if attempt or not self._make_dirs():
                    self.write_errors += 1
                    return False
                try:
                    path.parent.mkdir(exist_ok=True)
                except OSError as e:
                    self.write_errors += 1
                    self._log("write", "KV tier directory %s cannot be created: %s",
                              path.parent, e)
                    return False
            except OSError as e:
                self.write_errors += 1
                self._log("write", "KV tier record %s cannot be created: %s", tmp, e)
                return False
        try:
            try:
                self._write_record(fd, parts)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:  # a full disk, mostly: the block stays in memory only
            self.write_errors += 1
            self._log("write", "KV tier record %s not written: %s", path, e)
            _unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                # the disk holds less than the bound: shrink to what fits, oldest out first
                self.evict(int(self._bytes * EVICT_MARGIN))
            return False
        self._note(key, size)
        if self._bytes > self.capacity_bytes:
            self.evict(int(self.capacity_bytes * EVICT_MARGIN))
        return True

    @staticmethod
    def _write_record(fd: int, parts: Sequence[bytes | memoryview]) -> None:
        for part in parts:
            view = memoryview(part).cast("B")
            while view.nbytes:
                n = os.write(fd, view)
                view = view[n:]

    def remove(self, key: bytes) -> None:
        self._forget(key)
        _unlink(self.path(key))

    def evict(self, target_bytes: int) -> None:
        """Unlink the least recently used records, every process's, down to `target_bytes`."""
        self.scan()
        while True:
            with self._lock:
                if self._bytes <= target_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
            _unlink(self.path(key))
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"tier_bytes": self._bytes, "tier_blocks": len(self._index),
                    "tier_bytes_limit": self.capacity_bytes, "tier_evictions": self.evictions,
                    "tier_write_errors": self.write_errors}

    def close(self) -> None:
        pass


def _unlink(path: str | Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
