"""The bytes of one KV block in the tier: a self-checking record.

A record names the block it holds (its key: the group-qualified chained block hash) and the
token ids it covers, then carries the KV payload exactly as the runner copied it out of the
pool (under tensor parallelism every rank's shard, in rank order: engine/executor/
tier_shards.py). A CRC-32 over everything after the fixed header catches a torn, truncated or
flipped file; the key and the token ids are compared on every read, so a record in the wrong
place, or a digest that collides, is refused rather than loaded. Layout (little-endian):

    magic "OKVB" | version u16 | key length u16 | token count u32 | payload length u64 |
    crc32 u32 | key | token ids (int64 each) | payload
"""

from __future__ import annotations

import struct
import zlib
from array import array
from collections.abc import Sequence

MAGIC = b"OKVB"
VERSION = 1
_HEADER = struct.Struct("<4sHHIQI")
HEADER_SIZE = _HEADER.size


class TierRecordError(ValueError):
    """A record that must not be loaded; the message says why."""


def encode(key: bytes, token_ids: Sequence[int], payload: bytes | bytearray | memoryview
           ) -> list[bytes | memoryview]:
    """The record as buffers to write one after the other (the payload is not copied)."""
    toks = array("q", token_ids).tobytes()
    body = memoryview(payload).cast("B")
    crc = zlib.crc32(body, zlib.crc32(toks, zlib.crc32(key)))
    header = _HEADER.pack(MAGIC, VERSION, len(key), len(token_ids), body.nbytes, crc)
    return [header, key, toks, body]


def record_size(key: bytes, num_tokens: int, payload_len: int) -> int:
    return HEADER_SIZE + len(key) + 8 * num_tokens + payload_len


def decode(data: bytes | bytearray | memoryview, key: bytes,
           token_ids: Sequence[int]) -> memoryview:
    """The payload of a record that holds block `key` over `token_ids`, or TierRecordError."""
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise TierRecordError(f"truncated: {view.nbytes} bytes, shorter than a header")
    magic, version, key_len, num_tokens, payload_len, crc = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise TierRecordError(f"not a KV block record (magic {bytes(magic)!r})")
    if version != VERSION:
        raise TierRecordError(f"record version {version}, this build reads {VERSION}")
    expected = record_size(b"\0" * key_len, num_tokens, payload_len)
    if view.nbytes != expected:
        raise TierRecordError(f"truncated or overlong: {view.nbytes} bytes, the header says "
                              f"{expected}")
    body = view[HEADER_SIZE:]
    if zlib.crc32(body) != crc:
        raise TierRecordError("checksum mismatch")
    if body[:key_len] != key:
        raise TierRecordError("holds another block (key mismatch)")
    toks = body[key_len:key_len + 8 * num_tokens]
    if toks != array("q", token_ids).tobytes():
        raise TierRecordError("holds other token ids")
    return body[key_len + 8 * num_tokens:]
